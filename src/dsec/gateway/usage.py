"""One resource-usage sample of a sandbox, taken by a small shell script run inside it.

The sandbox's own cgroup (v2 ``cpu.stat``/``memory.current``, v1 ``cpuacct``/``memory``)
when the backend shows it one, else ``/proc`` (a microVM is its own machine); the disk is
that of ``/``. CPU is measured over :data:`INTERVAL_S`.
"""

from __future__ import annotations

INTERVAL_S = 0.2
SCRIPT = f"""\
c=/sys/fs/cgroup
cpu() {{
  if [ -r $c/cpu.stat ]; then awk '/^usage_usec /{{printf "%.0f000\\n", $2}}' $c/cpu.stat
  elif [ -r $c/cpuacct/cpuacct.usage ]; then cat $c/cpuacct/cpuacct.usage
  else awk '/^cpu /{{printf "%.0f0000000\\n", $2+$3+$4+$7+$8}}' /proc/stat; fi
}}
echo cpu0 $(cpu) $(date +%s%N)
sleep {INTERVAL_S}
echo cpu1 $(cpu) $(date +%s%N)
if [ -r $c/memory.current ]; then
  echo mem_used $(cat $c/memory.current); awk '/^file /{{print "mem_cache", $2}}' $c/memory.stat
elif [ -r $c/memory/memory.usage_in_bytes ]; then
  echo mem_used $(cat $c/memory/memory.usage_in_bytes)
  awk '/^total_cache /{{print "mem_cache", $2}}' $c/memory/memory.stat
else
  awk '/^MemTotal:/{{t=$2}} /^MemAvailable:/{{a=$2}} /^Cached:/{{k=$2}}
    END{{printf "mem_used %.0f\\nmem_total %.0f\\n", (t-a)*1024, t*1024;
         printf "mem_cache %.0f\\n", k*1024}}' /proc/meminfo
fi
df -P -k / | awk 'NR==2{{printf "disk_total %.0f\\ndisk_used %.0f\\n", $2*1024, $3*1024}}'
"""


def parse(out: str) -> dict[str, float]:
    """The script's output as numbers; ``cpu_core_pct`` is % of one core (missing lines
    are left out)."""
    got: dict[str, list[float]] = {}
    for line in out.splitlines():
        name, *values = line.split()
        try:
            got[name] = [float(v) for v in values]
        except ValueError:
            continue
    sample = {k: v[0] for k, v in got.items() if len(v) == 1}
    c0, c1 = got.get("cpu0", []), got.get("cpu1", [])
    if len(c0) == 2 and len(c1) == 2 and c1[1] > c0[1]:
        sample["cpu_core_pct"] = max(0.0, 100.0 * (c1[0] - c0[0]) / (c1[1] - c0[1]))
    return sample
