"""Turn a model argument (local dir, synthetic preset name, or Hugging Face hub id) into a local directory."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile

from qwen35 import synth

# What an inference engine needs from a hub repo (no vision-only extras such as preprocessor images).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt", "vocab.json"]
# Bump when the synthetic layout changes so that cached checkpoints are rebuilt.
SYNTH_VERSION = 1
_STAMP = "synth.json"


def cache_root(cache_dir: str | None = None) -> str:
    return cache_dir or os.environ.get("QWEN35_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qwen35")


def resolve_model(name_or_path: str, cache_dir: str | None = None, load_format: str = "safetensors") -> str:
    """Local directory holding config.json for `name_or_path`.

    * a directory with config.json -> itself
    * a tiny preset (`tiny`, `tiny-dense`) -> synthesized once under `<cache>/synth/<preset>`
      (cache = `cache_dir`, else `$QWEN35_CACHE`, else `~/.cache/qwen35`)
    * a full-size preset with load_format "dummy" -> its config and tokenizer only (the weights are made on
      the GPU), under `<cache>/synth/<preset>-config`
    * a hub id (`Qwen/Qwen3.5-35B-A3B`) -> the Hugging Face cache snapshot, else a download
    """
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path!r} is a directory without config.json, not a model directory")
        return os.path.abspath(path)
    if name_or_path in synth.TINY_PRESETS:
        return _synthesized(name_or_path, os.path.join(cache_root(cache_dir), "synth"))
    if name_or_path in synth.PRESETS and load_format in ("dummy", "dummy-spec"):
        return _synthesized(name_or_path, os.path.join(cache_root(cache_dir), "synth"), weights=False)
    if name_or_path in synth.PRESETS:
        raise ValueError(
            f"{name_or_path!r} is a full-size synthetic preset, too big to synthesize implicitly. Use "
            f"`--load-format dummy` (random weights, no files), or write it once with "
            f"`python -m qwen35.synth --preset {name_or_path} --out DIR` and pass DIR."
        )
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        return _from_hub(name_or_path)
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a local model directory, nor a preset ({', '.join(synth.TINY_PRESETS)}), "
        "nor a Hugging Face id like Qwen/Qwen3.5-35B-A3B"
    )


def _synthesized(preset: str, root: str, weights: bool = True) -> str:
    """Synthesize `preset` once: built in a temp dir and renamed into place, under a file lock, so that
    concurrent ranks/processes never see half a checkpoint and only one of them does the work."""
    final = os.path.join(root, preset if weights else f"{preset}-config")
    if _fresh(final):
        return final
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{preset}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _fresh(final):  # another process finished it while we waited
            return final
        tmp = tempfile.mkdtemp(prefix=f".{preset}.tmp-", dir=root)
        try:
            with_tokenizer = _tokenizer_available()
            synth.write_checkpoint(tmp, preset, tokenizer=with_tokenizer, weights=weights)
            with open(os.path.join(tmp, _STAMP), "w") as f:
                json.dump({"preset": preset, "seed": 0, "synth_version": SYNTH_VERSION,
                           "tokenizer": with_tokenizer}, f)
            if os.path.exists(final):  # stale (older layout): move it aside, then swap in the new one
                old = tempfile.mkdtemp(prefix=f".{preset}.old-", dir=root)
                os.rename(final, os.path.join(old, preset))
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fresh(path: str) -> bool:
    """Complete, of the current layout, and with tokenizer files unless the tokenizer module is missing."""
    try:
        with open(os.path.join(path, _STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    return stamp.get("synth_version") == SYNTH_VERSION and (stamp.get("tokenizer") or not _tokenizer_available())


def _tokenizer_available() -> bool:
    # qwen35.tokenizer is developed in parallel; until it lands, tiny presets are written without tokenizer files
    # (and rebuilt with them once it exists).
    return importlib.util.find_spec("qwen35.tokenizer") is not None


def _from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:  # the local HF cache first: no network, and works with HF_HUB_OFFLINE=1
        path = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True)
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    except Exception:  # not cached (LocalEntryNotFoundError and friends): fall through to a download
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as e:
        raise RuntimeError(
            f"model {repo_id!r} is not in the Hugging Face cache and the hub is unreachable "
            f"({type(e).__name__}: {e}). Download it where the hub is reachable (`hf download {repo_id}`), copy "
            "the directory here and pass its path as the model, or use a synthetic model: `tiny`, `tiny-dense`, "
            "or `--load-format dummy`."
        ) from e
