"""Tests for llm_otel.demo.tiny_model (no vLLM; a real build takes a few seconds)."""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import pytest

try:
    from llm_otel.demo import tiny_model
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    from llm_otel.demo import tiny_model

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from llm_otel.demo.tiny_model import (  # noqa: E402
    BUILD_FORMAT,
    MARKER_NAME,
    default_tiny_model_path,
    ensure_tiny_model,
    is_complete,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One real build shared by the tests of this module."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_build_publishes_every_model_file_and_the_marker_by_rename_in_under_20_mib(built: pathlib.Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (built / name).is_file(), name
    assert (built / MARKER_NAME).read_text(encoding="utf-8").strip() == BUILD_FORMAT
    assert is_complete(built)
    # Published by rename: no temporary siblings are left behind.
    leftovers = [p.name for p in built.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []
    size = sum(p.stat().st_size for p in built.iterdir())
    assert size < 20 * 1024 * 1024


def test_built_config_is_a_two_layer_llama_with_head_dim_64_and_a_2048_vocabulary(built: pathlib.Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(built)
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert getattr(cfg, "head_dim", 64) == 64
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (2048, 2, 2)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert cfg.tie_word_embeddings is False


def test_second_call_does_not_rebuild(built: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}

    def fail(*_args: object) -> None:
        raise AssertionError("rebuilt a complete model")

    monkeypatch.setattr(tiny_model, "_build", fail)
    messages: list[str] = []
    again = ensure_tiny_model(built, progress=messages.append)
    assert again == built
    assert messages == []
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_tokenizer_round_trip_and_bos(built: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    text = "def foo(x):\n    return x + 1  # héllo, wörld"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 == tok.bos_token_id
    assert ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    assert tok.convert_tokens_to_ids("<|user|>") == 5
    assert max(tok.get_vocab().values()) < 2048


def test_chat_template_renders_role_tags_and_the_generation_prompt(built: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>be brief<|end|><|user|>hello<|end|><|assistant|>"
    plain = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert plain.endswith("<|end|>")


def test_two_builds_are_byte_identical(built: pathlib.Path, tmp_path: pathlib.Path) -> None:
    other = ensure_tiny_model(tmp_path / "again")
    assert other != built
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_default_path_is_under_llm_otel_cache_dir_else_the_home_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("LLM_OTEL_CACHE_DIR", str(tmp_path))
    assert default_tiny_model_path() == tmp_path / "tiny-llama"
    monkeypatch.delenv("LLM_OTEL_CACHE_DIR")
    assert default_tiny_model_path() == pathlib.Path.home() / ".cache" / "llm-otel" / "tiny-llama"


# --- publishing logic, with a fake (instant) build --------------------------


def _fake_build(out: pathlib.Path, say: object) -> None:
    for name in tiny_model._REQUIRED_FILES:
        (out / name).write_text(name, encoding="utf-8")


def test_a_directory_holding_other_files_is_refused_and_left_untouched(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "precious.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(target)
    assert (target / "precious.txt").read_text(encoding="utf-8") == "keep me"


def test_failed_build_leaves_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(out: pathlib.Path, say: object) -> None:
        (out / "config.json").write_text("{}", encoding="utf-8")
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "_build", boom)
    with pytest.raises(OSError, match="disk full"):
        ensure_tiny_model(tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_stale_and_empty_targets_are_replaced(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_model, "_build", _fake_build)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / MARKER_NAME).write_text("llm-otel-tiny-llama/0\n", encoding="utf-8")
    (stale / "old.bin").write_text("old", encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (stale, empty):
        assert ensure_tiny_model(target) == target
        assert is_complete(target)
    assert not (stale / "old.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "empty",
        "stale",
    ]


def test_concurrent_builders_all_get_the_one_published_model(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow_fake_build(out: pathlib.Path, say: object) -> None:
        time.sleep(0.05)
        _fake_build(out, say)

    monkeypatch.setattr(tiny_model, "_build", slow_fake_build)
    target = tmp_path / "model"
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(ensure_tiny_model(target))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [target] * 4
    assert is_complete(target)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []
