"""The Dockerfile parser and its argument helpers."""

from __future__ import annotations

import pytest

from dsec.edge.images import dockerfile as df
from dsec.edge.images.dockerfile import DockerfileError


def test_parses_forms_continuations_comments_and_case() -> None:
    text = """# syntax comment
ARG BASE=base
from ${BASE}

RUN apt-get update && \\
    echo done
# a comment between
CMD ["python3", "-m", "http.server"]
ENTRYPOINT /bin/sh -c 'exec x'
COPY --chown=app:app src/ /app/
"""
    ins = df.parse(text)
    assert [i.keyword for i in ins] == ["ARG", "FROM", "RUN", "CMD", "ENTRYPOINT", "COPY"]
    assert ins[2].line == 5
    assert ins[2].text == "apt-get update && echo done"
    assert ins[3].exec_form == ("python3", "-m", "http.server")
    assert df.command(ins[4]) == ["/bin/sh", "-c", "/bin/sh -c 'exec x'"]
    assert ins[5].flags == {"chown": "app:app"}
    assert ins[5].text == "src/ /app/"
    assert df.copy_args(ins[5], {}) == (["src/"], "/app/")


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("RUN true\n", 1, "before FROM"),
        ("FROM base\nFROM base\n", 2, "multi-stage"),
        ("FROM base\n\nFROBNICATE x\n", 3, "unknown instruction"),
        ("FROM base\nRUN\n", 2, "needs arguments"),
        ("FROM base\nCOPY --from=x a b\n", 2, "multi-stage"),
        ("FROM base\nCOPY --mode=1 a b\n", 2, "unknown or empty COPY flag"),
        ("FROM base\nVOLUME /data\n", 2, "VOLUME"),
        ("# only a comment\n", 1, "no FROM"),
        ('FROM base\nCOPY ["a", \n', 2, "malformed JSON"),
    ],
)
def test_bad_dockerfiles_name_the_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(DockerfileError) as info:
        df.parse(text)
    assert info.value.line == line
    assert f"Dockerfile line {line}:" in str(info.value)
    assert fragment in str(info.value)


def test_expansion_defaults_and_alternatives() -> None:
    values = {"A": "1", "EMPTY": ""}
    assert df.expand("$A ${A} ${B:-two} ${A:+yes} ${B:+no}x \\$A", values) == "1 1 two yes x $A"
    assert df.expand("${EMPTY:-d}", values) == "d"


def test_env_and_label_pairs() -> None:
    env = df.parse('FROM base\nENV A=1 B="two words" C=$A\nENV LEGACY some value\n')
    assert df.key_values(env[1], {"A": "x"}) == [("A", "1"), ("B", "two words"), ("C", "x")]
    assert df.key_values(env[2], {}) == [("LEGACY", "some value")]
    bad = df.parse("FROM base\nENV 1X=2\n")
    with pytest.raises(DockerfileError, match="invalid variable name"):
        df.key_values(bad[1], {})


def test_arg_declarations() -> None:
    ins = df.parse('ARG A\nARG B=2\nARG C="x y"\nFROM base\n')
    assert [df.arg_decl(i) for i in ins[:3]] == [("A", None), ("B", "2"), ("C", "x y")]
    with pytest.raises(DockerfileError, match="invalid ARG"):
        df.arg_decl(df.parse("ARG 9x\nFROM base\n")[0])


def test_source_is_stable_and_includes_flags() -> None:
    a = df.parse("FROM base\nCOPY --chown=1:1 a /b\n")[1]
    b = df.parse("FROM base\ncopy   --chown=1:1 a /b\n")[1]
    assert a.source == b.source == "COPY --chown=1:1 a /b"
