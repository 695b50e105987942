"""Create a sandbox, run Python in it, and show where to go next.

Run on the machine where `dsec up` ran: the SDK finds the local API and admin key by itself.
"""

from dsec.sdk import Sandbox

with Sandbox.create(image="base", cpu=1, memory_mb=256, timeout=120) as sbx:
    print(f"sandbox {sbx.id} is running")
    result = sbx.exec(["python3", "-c", "import platform, sys; print('hello from', platform.node(), 'python', sys.version.split()[0])"])
    print(result.stdout.strip())
    sbx.files.write("/root/note.txt", "written through the SDK\n")
    print(sbx.exec("cat /root/note.txt && uname -sr").stdout.strip())
    shell = sbx.shell("main")
    shell.run("cd /tmp && export GREETING=hi")
    print("shell keeps state:", shell.run("echo $GREETING from $PWD").stdout.strip())

print("""
Next:
  .venv/bin/dsec sandbox create            # prints a sandbox id
  .venv/bin/dsec sandbox exec ID -- python3 -c 'print(6*7)'
  .venv/bin/dsec sandbox shell ID          # interactive shell
  .venv/bin/dsec sandbox ls ; .venv/bin/dsec sandbox kill ID
  .venv/bin/dsec status ; .venv/bin/dsec down
SDK: from dsec.sdk import Sandbox  (see README.md)""")
