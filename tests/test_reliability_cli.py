"""Bad numbers are refused with the value, the allowed range and the setting; every CLI error is one line.

Each test is written from a reproduction in the issue: the old code answered these with wrong numbers ("fits" with
118.77 GiB of capacity on an 80 GB card), raw TypeError / MemoryError, "no GPU fits" for a bad input, exit 1, or
a traceback.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper.cli import build_parser, main
from contextkeeper.diagnose import ProfileSettings
from contextkeeper.memory import ModelSpec, PlanSettings, RuntimeSettings, find_gpu, kv_report, plan, recommend
from tiny_models import TINY_LLAMA

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "llama-3.1-8b"


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    """The single stderr line of a CLI error (fails on a traceback or a multi-line usage message)."""
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert err.startswith("contextkeeper: ")
    return err.strip()


def _json_error(out: str) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(out)["error"]
    assert set(error) == {"type", "message", "fix"}
    return error


# ------------------------------------------------------------------------------------ 10. bad numbers


@pytest.mark.parametrize("value", ["1.5", "-0.5", "nan", "inf", "0"])
def test_gpu_memory_utilization_outside_0_1_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--gpu-memory-utilization 1.5` reported "fits" with 118.77 GiB capacity on an 80 GB H100."""
    argv = ["plan", "--model", LLAMA, "--gpu", "H100", "--context", "8192", f"--gpu-memory-utilization={value}"]
    code, out, err = _run(capsys, [*argv, "--json"])
    assert code == 2
    line = _one_error_line(err)
    assert "ConfigurationError" in line
    assert "gpu_memory_utilization" in line
    assert "--gpu-memory-utilization" in line
    assert "(0, 1]" in line  # the allowed range
    assert f"got {float(value)!r}" in line  # the value
    error = _json_error(out)
    assert error["type"] == "ConfigurationError"
    assert "(0, 1]" in error["fix"]
    with pytest.raises(ck.ConfigurationError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        PlanSettings(gpu_memory_utilization=float(value))


def test_every_float_setting_refuses_nan_and_inf() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        for field in ("gpu_memory_utilization", "mem_fraction_static"):
            with pytest.raises(ck.ConfigurationError, match=f"{field} must be a number in"):
                PlanSettings(**{field: bad})
        with pytest.raises(ck.ConfigurationError, match="jump_factor"):
            ProfileSettings(jump_factor=bad)
    assert PlanSettings(gpu_memory_utilization=1).gpu_memory_utilization == 1.0  # an int is a fine float


def test_gpu_given_as_an_int_is_a_typed_error() -> None:
    """`ContextKeeper(..., gpu=48)` was a raw TypeError from a regular expression."""
    with pytest.raises(ck.ConfigurationError, match=r"got 48 \(an int\)\. Fix: gpu='48GB'") as caught:
        ck.ContextKeeper("mistral:tekken", model=LLAMA, gpu=48)
    assert caught.value.fix_text() == "gpu='48GB'"
    for bad in (48, 4.5, None, ["H100"]):
        with pytest.raises(ck.ConfigurationError, match="gpu must be a GPU name"):
            find_gpu(bad)  # type: ignore[arg-type]
    with pytest.raises(ck.UnknownGPU, match="at most 65,536GB"):
        find_gpu("9999999GB")


def test_a_gpu_too_small_for_the_weights_blames_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """On a 0.5 GB device the weights do not fit: the answer must say so, not "use fewer sequences"."""
    result = plan(LLAMA, "0.5GB", context=8192)
    assert result.max_context == 0
    with pytest.raises(ck.ConfigurationError, match=r"the weights alone take 14\.96 GiB") as caught:
        result.context_limit()
    message = str(caught.value)
    assert "sequences" not in message
    assert "Fix: a quantised checkpoint" in message
    assert result.no_context == message
    assert result.notes[0] == message  # `plan` shows it too
    code, out, _ = _run(capsys, ["plan", "--model", LLAMA, "--gpu", "0.5GB", "--context", "8192"])
    assert code == 1
    assert "note: no context fits" in out
    assert "the weights alone take" in out
    # Where the weights fit but the sequences do not, it is the concurrency that is named, with its limit.
    crowded = plan(LLAMA, "24GB", context=100, concurrency=100_000)
    with pytest.raises(ck.ConfigurationError, match=r"for 100,000 sequences at once.*Fix: lower concurrency"):
        crowded.context_limit()
    assert plan(LLAMA, "H100", context=8192).context_limit() == 131072


@pytest.mark.parametrize(
    ("flags", "setting"),
    [
        (["--context", "8192", "--concurrency", "0"], "concurrency"),
        (["--context", "-1"], "context"),
        (["--context", "8192", "--max-gpus", "0"], "max_gpus"),
        (["--context", "8192", "--kind", "gaming"], "kinds"),
        (["--context", "8192", "--kv-dtype", "q9_0"], "--kv-dtype"),
        (["--context", "8192", "--block-size", "0"], "block_size"),
    ],
)
def test_recommend_rejects_bad_input_instead_of_no_gpu_fits(
    flags: list[str], setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`recommend --concurrency 0` (or --context -1, --max-gpus 0) said "no GPU in the catalog fits"."""
    code, out, err = _run(capsys, ["recommend", "--model", LLAMA, *flags])
    assert code == 2
    line = _one_error_line(err)
    assert "ConfigurationError" in line
    assert setting in line
    assert "no GPU" not in out + err


def test_recommend_in_python_rejects_the_same_values() -> None:
    with pytest.raises(ck.ConfigurationError, match=r"concurrency must be an integer from 1 to 1,048,576"):
        recommend(LLAMA, context=8192, concurrency=0)
    with pytest.raises(ck.ConfigurationError, match=r"max_gpus must be an integer from 1 to 1,024 .*, got 0"):
        recommend(LLAMA, context=8192, max_gpus=0)
    with pytest.raises(ck.ConfigurationError, match="context must be an integer"):
        recommend(LLAMA, context=-1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan(LLAMA, "H100", context=8192.0), r"context must be an integer .*got 8192\.0: a float"),
        (lambda: plan(LLAMA, "H100", context=8192, concurrency=True), r"concurrency .*got True: a bool"),
        (lambda: plan(LLAMA, "H100", context=8192, gpus=0), r"gpus must be an integer from 1 to 1,024"),
        (lambda: plan(LLAMA, "H100", context=2**31), r"context must be .*: too large"),
        (lambda: plan(LLAMA, "H100", context="8192"), r"context must be an integer .*: a str"),
        (lambda: plan(LLAMA, "H100", context=None), r"context must be an integer .*got None: required"),
        (lambda: kv_report(ModelSpec.from_config(LLAMA), 1.5), r"tokens must be an integer .*a float"),
        (lambda: kv_report(ModelSpec.from_config(LLAMA), 10, 0), r"sequences must be an integer from 1"),
        (lambda: ModelSpec.from_config(LLAMA).kv(10, tp=0), r"tp must be an integer from 1"),
        (lambda: PlanSettings(max_num_batched_tokens=2048.0), r"max_num_batched_tokens .*a float"),
        (lambda: PlanSettings(attn_implementation="fast"), r"attn_implementation must be one of 'sdpa'"),
        (lambda: RuntimeSettings(block_size=True), r"block_size .*a bool"),
        (lambda: RuntimeSettings(phase="later"), r"phase must be one of 'plan', 'steady'"),
        (lambda: ProfileSettings(lengths=(16, 0)), r"lengths must be an integer from 1"),
        (lambda: plan(LLAMA, "H100", context=8192, settings={"gpu_memory_utilization": 0.5}), "PlanSettings"),
    ],
)
def test_numbers_are_checked_in_the_python_api(call: Any, message: str) -> None:
    with pytest.raises(ck.ConfigurationError, match=message) as caught:
        call()
    assert "Fix:" in str(caught.value)


def test_a_config_with_absurd_sizes_is_refused_before_anything_is_allocated() -> None:
    """A config with 10¹² layers was a raw MemoryError (a list of 10¹² layer kinds)."""
    base = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers must be an integer from 0 to 10,000, got 1000000000000"),
        ({"num_attention_heads": 2**40}, r"num_attention_heads must be an integer"),
        ({"vocab_size": 10**12}, r"vocab_size must be an integer from 0 to 16,777,216"),
        ({"vocab_size": True}, r"vocab_size .*a bool"),
        ({"intermediate_size": 14336.0}, r"intermediate_size .*a float"),
        ({"intermediate_size": "big"}, r"intermediate_size .*a str"),
        ({"sliding_window": math.nan}, r"sliding_window .*a float"),
        ({"head_dim": -8}, r"head_dim must be an integer from 0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": math.inf}}, r"rope_scaling factor must be a number"),
        ({"model_type": "mamba", "expand": math.nan}, r"expand must be a number in \(0, 1024\]"),
    ]
    for change, message in cases:
        config = {**base, **change}
        before = copy.deepcopy(config)
        with pytest.raises(ck.ModelConfigError, match=message):
            ModelSpec.from_config(config)
        assert repr(config) == repr(before)  # the caller's dict is not changed
    assert ModelSpec.from_config({**base, "sliding_window": False}).kinds() == {"full": 32}  # "no window"


def test_a_config_file_that_is_not_utf8_is_a_model_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_bytes(b'\xff\xfe{"num_hidden_layers": 2}')
    with pytest.raises(ck.ModelConfigError, match="is not UTF-8 text"):
        ModelSpec.from_config(bad)


def test_doctor_refuses_context_zero_instead_of_using_the_models_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, ["doctor", "--symptom", "load", "--model", LLAMA, "--gpu", "H100", "--context", "0"])
    assert code == 2
    assert "context must be an integer from 1" in _one_error_line(err)
    code, _, err = _run(capsys, ["doctor", "--symptom", "load", "--concurrency", "0"])  # refused without facts too
    assert code == 2
    assert "concurrency must be an integer from 1" in _one_error_line(err)


# --------------------------------------------------------------------------- 12. one line, exit 2, JSON


def _messages(tmp_path: Path) -> Path:
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": "hello"}]), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.json", "does not exist"),
        (lambda d: d, "is a folder, not a file"),
        (
            lambda d: (
                (d / "latin1.json").write_bytes(b'[{"role": "user", "content": "caf\xe9"}]') and d / "latin1.json"
            ),
            "is not UTF-8 text",
        ),
        (lambda d: (d / "broken.json").write_text("[{", encoding="utf-8") and d / "broken.json", "is not valid JSON"),
        (lambda d: (d / "object.json").write_text("{}", encoding="utf-8") and d / "object.json", "not a list"),
    ],
)
def test_bad_messages_files_are_one_line_and_exit_2(
    make: Any, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing or invalid files exited 1; a folder or a non-UTF-8 file gave a traceback."""
    path = make(tmp_path)
    code, out, err = _run(capsys, ["count", "--tokenizer", "mistral:tekken", "--messages", str(path), "--json"])
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith("contextkeeper: ConfigurationError: messages file")
    assert message in line
    error = _json_error(out)
    assert error["type"] == "ConfigurationError"
    assert message in error["message"]
    assert error["fix"].startswith(("pass --messages", "--messages takes a JSON list"))


def test_a_missing_chat_template_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fit", "--tokenizer", "mistral:tekken", "--messages", str(_messages(tmp_path)), "--context", "512"]
    code, out, err = _run(capsys, [*argv, "--max-tokens", "64", "--chat-template", str(tmp_path / "none.jinja")])
    assert code == 2
    assert "chat template file" in _one_error_line(err)
    assert "does not exist" in err
    assert out == ""  # no --json: stderr only


def test_a_plot_into_a_missing_folder_is_refused_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "plan.png"
    argv = ["plan", "--model", LLAMA, "--gpu", "H100", "--context", "8192", "--plot", str(target), "--json"]
    code, out, err = _run(capsys, argv)
    assert code == 2
    assert "does not exist" in _one_error_line(err)
    assert _json_error(out)["fix"] == "create it, or pass --plot a path in an existing folder"
    assert not target.parent.exists()


def test_a_raw_library_error_is_one_line_naming_its_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any exception escaping a command, ours or not, becomes one line and exit 2: here transformers' own
    ValueError for an attention implementation it does not know."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    argv = ["profile", "--model", str(tmp_path), "--device", "cpu", "--lengths", "8", "--new-tokens", "1"]
    code, out, err = _run(capsys, [*argv, "--batches", "1", "--attn-implementation", "bogus", "--json"])
    assert code == 2
    assert _one_error_line(err).startswith("contextkeeper: ValueError: ")
    error = _json_error(out)
    assert error["type"] == "ValueError"
    assert "bogus" in error["message"]
    assert error["fix"] is None
    code, _, err = _run(capsys, [*argv, "--device", "tpu9"])
    assert code == 2
    assert "profile device 'tpu9' is not a device torch knows" in _one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--model", LLAMA], "plan: the following arguments are required: --context, --gpu"),
        (["kv", "--model", LLAMA, "--tokens", "many"], "kv: argument --tokens: invalid int value: 'many'"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        (["policy"], "policy: the following arguments are required: ACTION"),
    ],
)
def test_usage_errors_are_one_line_exit_2_and_json_with_json(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, argv)
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith("contextkeeper: UsageError: ")
    assert needle in line
    assert "--help" in line  # the fix
    assert out == ""
    code, out, err = _run(capsys, [*argv, "--json"])
    assert code == 2
    error = _json_error(out)
    assert error["type"] == "UsageError"
    assert needle.split(": ", 1)[-1].split(",")[0] in error["message"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"contextkeeper {ck.__version__}\n"


def test_the_console_script_prints_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextkeeper", "kv", "--model", str(tmp_path), "--tokens", "8", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout)["error"]["type"] == "ModelConfigError"


# ---------------------------------------------------------------------------------------- frictions


def _subcommands(parser: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, child in action.choices.items():
            if hasattr(child, "_actions"):
                found[f"{parser.prog} {name}"] = child
                found.update(_subcommands(child))
    return found


def test_every_subcommand_has_a_description_and_shows_its_defaults() -> None:
    commands = _subcommands(build_parser())
    assert {"contextkeeper plan", "contextkeeper policy", "contextkeeper policy validate"} <= set(commands)
    for name, parser in commands.items():
        assert len(parser.description or "") > 40, name
    text = commands["contextkeeper plan"].format_help()
    for shown in ("(default: vllm)", "(default: 0.9)", "(default: 8192)", "(default: 16; MLA 64)", "(default: 1)"):
        assert shown in " ".join(text.split()), shown
    assert "(default: None)" not in text
    assert "(default: False)" not in text


def test_policy_validate_has_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = ROOT / "strategies" / "default.toml"
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nno_such_key = 1\n', encoding="utf-8")
    code, out, _ = _run(capsys, ["policy", "validate", str(good), "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["ok"] is True
    assert data["files"][0]["ok"] is True
    assert data["files"][0]["policy"] == "default"
    code, out, err = _run(capsys, ["policy", "validate", str(good), str(bad), "--json"])
    assert code == 1  # an answer ("this file is invalid"), not a failure of the command
    data = json.loads(out)
    assert [f["ok"] for f in data["files"]] == [True, False]
    assert "no_such_key" in data["files"][1]["error"]
    assert err.count("\n") == 1
    assert err.startswith("invalid: ")


def test_the_pytest_markers_name_scripts_that_exist() -> None:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    named = [
        word.strip(",.;:()`") for line in markers["markers"] for word in line.split() if word.endswith((".py", ".py,"))
    ]
    assert named, "the benchmark marker names its scripts"
    for script in named:
        assert (ROOT / script).is_file(), script
