"""Build a tiny, deterministic, random-weight Llama model that vLLM can load.

The demos and integration tests need a real model directory for vLLM to serve,
but must run without network access or a model hub. :func:`ensure_tiny_model`
builds one locally, from nothing but the Python standard library sources:

* **Tokenizer** -- byte-level BPE with a vocabulary of 2048 tokens, trained
  with the ``tokenizers`` library on the first 150 ``*.py`` files (sorted by
  name) of the running interpreter's standard library directory
  (``sysconfig.get_paths()["stdlib"]``). Special tokens, by id:
  ``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2, ``<|unk|>`` = 3,
  ``<|system|>`` = 4, ``<|user|>`` = 5, ``<|assistant|>`` = 6, ``<|end|>`` = 7.
  Encoding with special tokens prepends ``<|bos|>``. A Jinja chat template
  renders each message as ``<|role|>content<|end|>`` (roles ``system``,
  ``user``, ``assistant``) after a leading ``<|bos|>``, and ends with
  ``<|assistant|>`` when ``add_generation_prompt`` is true, so that
  ``vllm.LLM.chat`` works.
* **Model** -- ``LlamaForCausalLM`` with hidden size 256, 2 layers, 4 attention
  heads of dimension 64 (a head size vLLM's CPU attention supports), 2
  key/value heads, MLP size 512, 2048 positions, untied embeddings; weights
  drawn from transformers' default initialisation under
  ``torch.manual_seed(0)``, stored as float32 safetensors (about 9 MB), plus
  ``generation_config.json``.

The output only makes sense as a load and throughput test: the weights are
random, so generated text is noise. The build takes a few seconds on a CPU.
For a given Python standard library and given versions of ``torch``,
``transformers`` and ``tokenizers`` the produced files are byte-identical from
build to build.

The directory is published atomically: it is built in a temporary sibling
directory, completed with a marker file (:data:`MARKER_NAME`, holding
:data:`BUILD_FORMAT`) written last, and then renamed into place. A crash never
leaves a half-written model at the target path, and concurrent builders of the
same path do not corrupt each other (the loser discards its copy). The final
rename is serialised with an ``flock`` on an empty ``.<name>.lock`` file next to
the target, which is left in place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import keyword
import os
import pathlib
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator

__all__ = [
    "BUILD_FORMAT",
    "MARKER_NAME",
    "SPECIAL_TOKENS",
    "default_tiny_model_path",
    "ensure_tiny_model",
    "is_complete",
]

#: Name of the marker file written last into a finished model directory.
MARKER_NAME = ".llm-otel-complete"

#: Content of the marker file. Bump it whenever the produced files change, so
#: that stale builds in caches are rebuilt.
BUILD_FORMAT = "llm-otel-tiny-llama/1"

#: Special tokens in id order (``<|pad|>`` is id 0, ``<|bos|>`` id 1, ...).
SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|unk|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)

#: Environment variable naming the cache root; the model goes in ``tiny-llama``
#: below it.
CACHE_DIR_ENV = "LLM_OTEL_CACHE_DIR"

VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
_CORPUS_FILES = 150
_SEED = 0

# Files that must be present (besides the marker) for a build to count.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def default_tiny_model_path() -> pathlib.Path:
    """Return the default model directory.

    ``$LLM_OTEL_CACHE_DIR/tiny-llama`` when that environment variable is set
    and non-empty, else ``~/.cache/llm-otel/tiny-llama``. Nothing is created.
    """
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        base = pathlib.Path(root).expanduser()
    else:
        base = pathlib.Path.home() / ".cache" / "llm-otel"
    return base / "tiny-llama"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Tell whether *path* holds a finished build of the current format.

    True when the marker file exists and holds :data:`BUILD_FORMAT` and the
    model, config and tokenizer files are present. Never raises for a missing
    or unreadable directory; it returns False instead.
    """
    p = pathlib.Path(path)
    try:
        marker = (p / MARKER_NAME).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    if marker != BUILD_FORMAT:
        return False
    return all((p / name).is_file() for name in _REQUIRED_FILES)


def ensure_tiny_model(
    path: str | os.PathLike[str] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> pathlib.Path:
    """Return a directory holding the tiny Llama model, building it if needed.

    Args:
        path: Target directory. ``None`` means :func:`default_tiny_model_path`
            (``$LLM_OTEL_CACHE_DIR/tiny-llama``, else
            ``~/.cache/llm-otel/tiny-llama``). ``~`` is expanded. Missing
            parent directories are created.
        progress: Optional callback receiving short human-readable status
            lines (e.g. ``"training tokenizer"``); called only when a build
            actually happens.

    Returns:
        The absolute path of the model directory, loadable with
        ``vllm.LLM(model=str(path))`` or ``transformers`` ``from_pretrained``.

    If *path* already holds a complete build (see :func:`is_complete`) it is
    returned at once, without importing torch. Otherwise the model is built in
    a temporary sibling directory (a few seconds, about 9 MB on disk) and
    renamed into place; if another process finished the same path in the
    meantime, this build is discarded and that one is returned. A directory at
    *path* that holds an older build format is replaced.

    Raises:
        FileExistsError: *path* exists and is a non-empty directory that is not
            a build of this module (no marker file); it is never overwritten.
        NotADirectoryError: *path* exists and is not a directory.
        OSError: the directory (or its parent) cannot be created or written,
            e.g. ``PermissionError`` or a full disk. No partial model is left
            at *path*.
        ImportError: ``torch``, ``transformers`` or ``tokenizers`` is missing.
    """
    target = pathlib.Path(path).expanduser() if path is not None else default_tiny_model_path()
    target = target.absolute()
    if is_complete(target):
        return target
    _check_replaceable(target)

    say = progress if progress is not None else (lambda _msg: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        say(f"building tiny model in {tmp}")
        _build(tmp, say)
        (tmp / MARKER_NAME).write_text(BUILD_FORMAT + "\n", encoding="utf-8")
        _apply_umask_modes(tmp)
        _fsync_dir(tmp)
        with _lock(target):
            if is_complete(target):
                say(f"{target} was completed concurrently; discarding this build")
            else:
                _publish(tmp, target)
                say(f"tiny model ready at {target} ({time.monotonic() - started:.1f} s)")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------
# Publishing


def _check_replaceable(target: pathlib.Path) -> None:
    """Refuse targets that exist and are not (stale) builds of ours."""
    if not target.exists():
        return
    if not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "tiny model path exists and is not a directory", str(target))
    if (target / MARKER_NAME).exists():
        return  # an older build format: replaced after the new build is done
    if any(target.iterdir()):
        raise FileExistsError(
            errno.EEXIST,
            f"directory is not empty and holds no {MARKER_NAME} marker; refusing to overwrite it",
            str(target),
        )


def _publish(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Move the finished build *tmp* to *target* (called under the lock)."""
    try:
        os.rename(tmp, target)  # atomic; also replaces an empty dir on POSIX
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) and not isinstance(exc, FileExistsError):
            raise
    else:
        _fsync_dir(target.parent)
        return
    if is_complete(target):  # another builder won (no lock on this platform)
        return
    _check_replaceable(target)
    # An empty directory or a stale build format: move it aside, then swap in.
    aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, aside / "old")
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            with contextlib.suppress(OSError):
                os.rename(aside / "old", target)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(target.parent)


@contextlib.contextmanager
def _lock(target: pathlib.Path) -> Iterator[None]:
    """Serialise the publish step between processes (POSIX ``flock``).

    Without ``fcntl`` (Windows) this is a no-op; the rename is still atomic
    and the losing build is discarded.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    lock_path = target.parent / f".{target.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _apply_umask_modes(path: pathlib.Path) -> None:
    """Give *path* and its files ordinary modes (``mkdtemp`` makes it 0700).

    The process umask is read from a probe file rather than ``os.umask``,
    which would briefly change it for every thread.
    """
    probe = path / ".umask-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    try:
        file_mode = probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
    dir_mode = file_mode | ((file_mode & 0o444) >> 2)  # x wherever r
    for child in path.iterdir():
        if child.is_file():
            os.chmod(child, file_mode)
    os.chmod(path, dir_mode)


def _fsync_dir(path: pathlib.Path) -> None:
    """Flush *path*'s files and the directory entry itself (best effort)."""
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows
        return
    with contextlib.suppress(OSError):
        for child in path.iterdir():
            if child.is_file():
                fd = os.open(child, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------
# Building


def _build(out: pathlib.Path, say: Callable[[str], None]) -> None:
    say("training tokenizer")
    _build_tokenizer(out)
    say("initialising model weights")
    _build_model(out)


def _corpus() -> list[str]:
    """Training texts: the first stdlib ``*.py`` files by name, in order.

    Falls back to a small synthetic corpus (keywords and builtin names) when
    the standard library ships without sources, e.g. zipped in a frozen app.
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    try:
        files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    except OSError:
        files = []
    texts = []
    for p in files[:_CORPUS_FILES]:
        try:
            texts.append(p.read_bytes().decode("utf-8", errors="replace"))
        except OSError:
            continue
    if not texts:
        import builtins

        words = sorted(set(keyword.kwlist) | set(dir(builtins)))
        texts = [" ".join(words[i:] + words[:i]) + "\n" for i in range(len(words))]
    return texts


def _build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos, unk = SPECIAL_TOKENS[:4]
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:  # pragma: no cover - tokenizers contract
            raise RuntimeError(f"special token {token!r} did not get id {i}")
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A:0",
        pair=f"{bos} $A:0 {bos} $B:1",
        special_tokens=[(bos, bos_id)],
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        additional_special_tokens=list(SPECIAL_TOKENS[4:]),
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' "Writing model shards" progress bar for a moment."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_model(out: pathlib.Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config.dtype = torch.float32
    # Keep the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    with _quiet_transformers():
        model.save_pretrained(str(out), safe_serialization=True)

    gen = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gen.save_pretrained(str(out))

    # Everything below is informational; keep it deterministic (no timestamps).
    info = {
        "description": "random-weight tiny Llama built by llm_otel.demo.tiny_model",
        "build_format": BUILD_FORMAT,
        "seed": _SEED,
        "tokenizer_corpus": f"first {_CORPUS_FILES} *.py files of the Python stdlib",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "llm_otel_tiny_model.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
