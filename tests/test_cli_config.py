"""The command line as configuration (issue 30 item 5): TRSERVE_* environment variables for every
flag, `--version`, log flags after the command, JSON logs, and a parser that never imports torch
(so `trserve health` answers in a fraction of a second)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trserve.core.version import __version__
from trserve.services.cli import build_parser, main
from trserve.services.envconfig import apply_env, environment_doc

REPO = Path(__file__).resolve().parent.parent


def parse(argv: list[str], env: dict[str, str]):
    parser = build_parser()
    apply_env(parser, env)
    return parser.parse_args(argv)


def test_every_flag_may_come_from_the_environment_and_the_command_line_wins() -> None:
    args = parse(["serve"], {"TRSERVE_MAX_BATCH": "8", "TRSERVE_FULL_TREES": "yes", "TRSERVE_DEVICE": "cpu"})
    assert (args.max_batch, args.full_trees, args.device) == (8, True, "cpu")
    assert parse(["serve", "--max-batch", "4"], {"TRSERVE_MAX_BATCH": "8"}).max_batch == 4
    assert parse(["serve"], {}).max_batch == 16  # the built-in default
    # a required flag given by the environment; a repeatable one as a comma list
    assert parse(["worker"], {"TRSERVE_MATRIX_ADDR": "m:50052"}).matrix_addr == "m:50052"
    models = parse(["matrix"], {"TRSERVE_MODEL": "a:10:8, b:20:8"}).model
    assert models == ["a:10:8", "b:20:8"]


@pytest.mark.parametrize("env, message", [
    ({"TRSERVE_MAX_BATCH": "many"}, "TRSERVE_MAX_BATCH='many' is not a valid value for --max-batch"),
    ({"TRSERVE_FULL_TREES": "maybe"}, "TRSERVE_FULL_TREES='maybe' (for --full-trees): a switch takes one of"),
    ({"TRSERVE_KERNELS": "fast"}, "TRSERVE_KERNELS='fast' (for --kernels): choose from auto"),
    # issue 45, defect 6: ranges name the variable and flag too; LOUD is not a log level
    ({"TRSERVE_GRACE": "-5"}, "TRSERVE_GRACE='-5' is not a valid value for --grace: -5 is out of range"),
    ({"TRSERVE_GRACE": "nan"}, "TRSERVE_GRACE='nan' is not a valid value for --grace"),
    ({"TRSERVE_MAX_CONNECTION_AGE_S": "inf"}, "TRSERVE_MAX_CONNECTION_AGE_S='inf' is not a valid value for"),
    ({"TRSERVE_METRICS_PORT": "70000"}, "for --metrics-port: 70000 is out of range: it must be in 0..65535"),
    ({"TRSERVE_MAX_BATCH": "0"}, "TRSERVE_MAX_BATCH='0' is not a valid value for --max-batch: 0 is out of range"),
    ({"TRSERVE_LOG_LEVEL": "LOUD"}, "TRSERVE_LOG_LEVEL='LOUD' is not a valid value for --log-level"),
])
def test_a_value_a_flag_cannot_take_is_a_usage_error_naming_the_variable(env, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve"], environ=env)  # exits before anything starts
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_command_line_wins_over_a_bad_variable() -> None:
    """Issue 45, defect 6: TRSERVE_MAX_BATCH=abc with --max-batch 2 exited 2."""
    from trserve.services.envconfig import check_parsed

    args = parse(["serve", "--max-batch", "2", "--log-level", "debug"],
                 {"TRSERVE_MAX_BATCH": "abc", "TRSERVE_LOG_LEVEL": "LOUD"})
    check_parsed(args)
    assert (args.max_batch, args.log_level) == (2, "DEBUG")


@pytest.mark.parametrize("argv, message", [
    (["serve", "--grace", "-5"], "argument --grace: -5 is out of range"),
    (["matrix", "--metrics-port", "-2"], "argument --metrics-port: -2 is out of range"),
    (["serve", "--redis-url", "not-a-url"], "argument --redis-url: 'not-a-url' is not a Redis URL"),
    (["serve", "--max-request-bytes", "10"], "argument --max-request-bytes: 10 is out of range: it must be in 1024.."),
])
def test_a_flag_out_of_range_is_a_usage_error_naming_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv, environ={})
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--tree", "nosuch", "--port", "0"], "--tree: unknown tree 'nosuch'"),
    (["serve", "--model", "nosuch/model", "--port", "0", "--http-port", "0", "--metrics-port", "-1"],
     "model 'nosuch/model' is not a builtin name"),
    (["model-spec", "--model", "nosuch/model"], "model 'nosuch/model' is not a builtin name"),
])
def test_an_operators_wrong_name_is_one_line_at_once(argv, message, tmp_path) -> None:
    """Issue 45, defect 6: an unknown --tree printed a traceback, a model that is not installed one
    after ~51 s of hub retries. Now one line and exit 2, in seconds (no hub here: it fails to resolve)."""
    import time

    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "trserve.services.cli", *argv], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and time.monotonic() - started < 30


def test_the_documented_table_is_current() -> None:
    assert (REPO / "docs" / "environment.md").read_text() == environment_doc(build_parser()), \
        "regenerate docs/environment.md (see services/envconfig.py:environment_doc)"


def test_version_log_flags_after_the_command_and_json_logs(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"trserve {__version__}"
    args = build_parser().parse_args(["--log-level", "WARNING", "health", "--log-level", "DEBUG"])
    assert args.log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "WARNING", "health"]).log_level == "WARNING"


def test_json_logs_are_one_object_per_line() -> None:
    """Issue 46: times in ISO 8601 (UTC), and a request's id on the lines logged on its behalf."""
    from datetime import datetime

    code = ("import logging; from trserve.services.cli import main; "
            "from trserve.services.common.logcontext import REQUEST_ID; "
            "main(['--log-format', 'json', 'health', '--addr', '127.0.0.1:1', '--timeout-s', '0.2'], {}); "
            "logging.getLogger('trserve.test').warning('hello %s', 'there'); REQUEST_ID.set('r-1'); "
            "logging.getLogger('trserve.test').warning('for r-1')")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    assert [line["message"] for line in lines] == ["hello there", "for r-1"], run.stderr
    assert set(lines[0]) == {"time", "level", "logger", "message"} and lines[1]["request_id"] == "r-1"
    assert lines[0]["time"].endswith("Z") and datetime.fromisoformat(lines[0]["time"]).utcoffset().total_seconds() == 0


def test_a_reader_that_goes_away_is_no_traceback(tmp_path) -> None:
    """Issue 46: `trserve generate --json | head` ended in a BrokenPipeError traceback. Here stdout is a
    pipe whose reader has already gone."""
    script = ("import os, sys\n"
              "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
              "from trserve.services.cli import main\n"
              "sys.exit(main(['secret', sys.argv[1]], {}))\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 141 and (tmp_path / "s").exists(), run.stderr
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr


def test_building_the_parser_imports_no_torch_and_health_answers_fast() -> None:
    code = "import sys; from trserve.services.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr
    health = subprocess.run([sys.executable, "-m", "trserve.services.cli", "health", "--addr", "127.0.0.1:1", "--timeout-s", "0.2"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert health.returncode == 1 and "UNREACHABLE" in health.stdout


def test_main_reads_the_environment_it_is_given() -> None:
    assert main(["health", "--timeout-s", "0.2"], {"TRSERVE_ADDR": "127.0.0.1:1"}) == 1
