"""Every default has one source in code (SamplingParams, Limits, Settings); the docs that show
the values are checked against it, so they cannot drift. No model, no server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stopline.protocol.requests import DEFAULT_SAMPLING, Limits
from stopline.protocol.vocabulary import AbortMode, Batching, EngineName, ModelNames
from stopline.settings import FLAGS, Settings

ROOT = Path(__file__).resolve().parents[1]


def table_rows(path: Path) -> list[list[str]]:
    """The cells of every Markdown table row in ``path``."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in path.read_text().splitlines()
        if line.startswith("| `")
    ]


def numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]


def test_the_generate_table_shows_the_protocol_defaults():
    documented = {row[0].strip("`"): row[2] for row in table_rows(ROOT / "docs" / "protocol.md") if len(row) == 4}
    expected = {
        "max_tokens": DEFAULT_SAMPLING.max_tokens,
        "temperature": DEFAULT_SAMPLING.temperature,
        "top_k": DEFAULT_SAMPLING.top_k,
        "top_p": DEFAULT_SAMPLING.top_p,
        "repetition_penalty": DEFAULT_SAMPLING.repetition_penalty,
        "timeout_s": Limits.default_timeout_s,
        "ttft_timeout_s": Limits.default_ttft_timeout_s,
    }
    for name, value in expected.items():
        assert numbers(documented[name]) == [value], (name, documented[name])


def test_the_server_settings_default_to_the_protocol_limits():
    config = Settings.build()
    limits = Limits(context_length=1, vocab_size=1)
    assert config.limits == Limits()
    for name in (
        "requests_per_connection",
        "requests_per_address",
        "default_timeout_s",
        "max_timeout_s",
        "default_ttft_timeout_s",
        "max_ttft_timeout_s",
        "frames_per_second",
        "frame_burst",
        "bytes_per_second",
    ):
        assert getattr(config.limits, name) == getattr(limits, name), name
    assert config.max_frame_bytes == limits.byte_burst


def test_each_flag_sets_one_setting_and_takes_its_default_from_there():
    # A flag names a field of the settings or of their limits, and every value the
    # command line gives builds the settings the same way the tests and the bench do.
    values = {flag.setting: flag.default for flag in FLAGS}
    assert Settings.build(**values) == Settings.build()
    assert Settings.build(default_timeout_s=900.0).limits.max_timeout_s == 900.0
    assert Settings.build(port=0).http_port_or_default == 0 and Settings.build(port=9).http_port_or_default == 10
    with pytest.raises(TypeError, match="no such setting"):
        Settings.build(no_such_setting=1)


@pytest.mark.parametrize(
    "flag, default",
    [
        (flag.flag, flag.default)
        for flag in FLAGS
        if isinstance(flag.default, (int, float)) and not isinstance(flag.default, bool)
    ],
)
def test_the_flag_table_shows_each_flag_default(flag, default):
    # docs/configuration.md's table is generated from FLAGS (tests/test_docs.py keeps it so);
    # this reads it as a reader would, so a default the generator mis-renders fails here.
    for row in table_rows(ROOT / "docs" / "configuration.md"):
        if len(row) == 4 and row[0] == f"`{flag}`":
            assert numbers(row[2]) == [default], (flag, row[2])
            return
    pytest.fail(f"docs/configuration.md's flag table shows no default for {flag}")


def test_the_flags_parse_to_members_without_the_compiled_engine():
    # --help, a bad flag and the settings all come before the native loop is loaded.
    script = (
        "import sys\n"
        "from stopline import __main__ as cli\n"
        "args = ['--engine', 'ctransformers', '--batching', 'shared', '--prompt-steps', 'alone']\n"
        "settings = cli.settings_from(cli.parse_args(args))\n"
        "print(type(settings.engine).__name__, type(settings.batching).__name__, settings.prompt_steps.name,\n"
        "      'stopline._core' in sys.modules)\n"
    )
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert shown.stdout.split() == ["EngineName", "Batching", "ALONE", "False"]


def test_a_choice_given_by_its_name_is_held_as_its_member():
    settings = Settings.build(engine="ctransformers", abort_mode="between_steps", batching="shared")
    assert settings.engine is EngineName.CTRANSFORMERS and settings.batching is Batching.SHARED
    assert settings.abort_mode is AbortMode.BETWEEN_STEPS and settings.model_names is ModelNames.ANY
    with pytest.raises(ValueError):
        Settings.build(batching="sometimes")
