"""Where a study's model comes from: a shape preset, a local checkpoint folder or the Hugging Face hub."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tuner.models import presets
from tuner.errors import HubUnreachable, ModelNotFound

# What vLLM's loaders read (default_loader.py: *.safetensors, *.bin, *.pt; mistral's
# consolidated*.safetensors; GGUF files), plus Meta's consolidated.*.pth.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Trainer leftovers with a weight suffix that hold no weights (vLLM filters them out too).
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt",
                         "scaler.pt", "rng_state.pth", "trainer_state.pt"})
CONFIG_FILES = ("config.json", "params.json")   # HF layout, mistral's own layout
SEARCH_DEPTH = 4
# An HF id: `org/name` or a bare `name` (gpt2), as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Hub files vLLM needs beside the weights; one weight format is fetched, not all of them.
_HUB_SIDE_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]

_said: set[str] = set()


def log_once(message: str) -> None:
    """One line on stderr, once per process however often the model is resolved."""
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- local folders


def weight_files(folder: Path) -> list[Path]:
    """The weight files at the top of a folder, where vLLM's loaders glob for them."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if p.suffix in WEIGHT_SUFFIXES and p.name not in NOT_WEIGHTS
                  and p.is_file())


def _is_tokenizer_file(name: str) -> bool:
    """A file a tokenizer may be loaded from (HF fast or slow, sentencepiece, tiktoken, mistral's
    tekken): permissive, since a tokenizer wrongly missed would refuse a model that serves."""
    name = name.lower()
    return (name.startswith(("tokenizer", "vocab", "spiece", "sentencepiece", "tekken"))
            or name in ("merges.txt",) or name.endswith((".tiktoken", ".model")))


def tokenizer_problem(model: str, extra_args=()) -> str | None:
    """Why vLLM would fail every launch of this model folder loading its tokenizer, or None.

    A folder of a config.json alone (a shape copied for what-if tuning) starts no server: vLLM
    reads the tokenizer from the model folder unless --tokenizer names another (and the load test
    needs /tokenize, so --skip-tokenizer-init is no way out either). A GGUF carries its own."""
    folder = Path(model)
    if not folder.is_dir() or any(a.partition("=")[0] == "--tokenizer" for a in extra_args):
        return None
    try:
        names = [p.name for p in folder.iterdir() if p.is_file()]
    except OSError:
        return None
    if any(_is_tokenizer_file(n) for n in names):
        return None
    return (f"{folder} holds no tokenizer (tokenizer.json, tokenizer.model, vocab.json, ...): every "
            "vLLM launch would fail loading one; copy the model's tokenizer files beside "
            "config.json, or add \"--tokenizer\", \"ORG/NAME or FOLDER\" to [server] extra_args")


def _is_model_dir(folder: Path) -> bool:
    return any((folder / name).is_file() for name in CONFIG_FILES)


def _hf_cache_snapshot(folder: Path) -> Path | None:
    """The snapshot of an HF cache repo folder (`models--org--name`): refs/main, else the newest."""
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = folder / "refs" / "main"
    if ref.is_file():
        chosen = snapshots / ref.read_text().strip()
        if chosen.is_dir():
            return chosen
    revisions = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return revisions[-1] if revisions else None


def find_checkpoint(folder: Path) -> tuple[Path, list[Path]]:
    """(the folder to give vLLM, its weight files) for a folder in any layout vLLM loads.

    The folder itself when it holds weights; an HF cache repo folder's snapshot; else the one
    nested folder that holds a config and weights (a checkpoint unpacked one level down, a copied
    HF snapshot). No weights anywhere: the folder itself and [] (served with dummy weights).
    """
    snapshot = _hf_cache_snapshot(folder)
    if snapshot is not None:
        folder = snapshot
    weights = weight_files(folder)
    if weights:
        return folder, weights
    found = []
    for root, dirs, _files in os.walk(folder, followlinks=True):
        here = Path(root)
        depth = len(here.relative_to(folder).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < SEARCH_DEPTH else []
        if here == folder:
            continue
        w = weight_files(here)
        if w:
            found.append((here, w))
            dirs[:] = []      # shards of one checkpoint, not checkpoints of their own
    with_config = [(d, w) for d, w in found
                   if _is_model_dir(d) or any(p.suffix == ".gguf" for p in w)]
    if len(with_config) == 1:
        return with_config[0]
    if len(with_config) > 1:
        names = ", ".join(str(d.relative_to(folder)) for d, _ in with_config)
        raise ModelNotFound(str(folder), f"holds several checkpoints ({names})",
                            "give the one folder to tune as [model] path")
    if found:
        d = found[0][0]
        raise ModelNotFound(str(folder), f"weights in {d.relative_to(folder)}/ but no config.json "
                            "beside them", "vLLM reads weights from the folder that holds "
                            "config.json: move them there, or point [model] path at that folder")
    return folder, []


def _local(model: str, path: Path) -> tuple[str, bool]:
    if path.is_file() and path.suffix == ".gguf":
        return str(path), False
    if path.exists() and not path.is_dir():
        raise ModelNotFound(model, "is a file, not a folder", "give the folder that holds config.json"
                            + (f": {path.parent}" if path.name in CONFIG_FILES else ""))
    if not path.is_dir():
        raise ModelNotFound(model, "the folder does not exist", "give a folder with config.json, an HF id "
                            "(org/name) or preset:NAME")
    served, weights = find_checkpoint(path)
    ggufs = [p for p in weights if p.suffix == ".gguf"]
    if not _is_model_dir(served) and len(ggufs) == 1:
        return str(ggufs[0]), False     # vLLM takes a lone GGUF by its file name
    if not _is_model_dir(served) and not ggufs:
        raise ModelNotFound(model, f"{served} has no config.json, so it is no model folder",
                            "give the folder that holds config.json and the weights")
    if served != path:
        log_once(f"model {model}: serving the checkpoint in {served}")
    return str(served), not weights


# ---------------------------------------------------------------- the hub


def hub_cache_dir() -> Path:
    """The HF hub cache as the environment names it now (huggingface_hub reads it only at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_weight_patterns(files: list[str]) -> list[str]:
    """allow_patterns for a repo's file list: its side files and the one weight format vLLM loads.

    Llama repos carry an `original/` copy in Meta's format beside the safetensors: fetching both
    would double the download, so only top-level files of the first format vLLM tries are taken.
    """
    top = [f for f in files if "/" not in f]
    for suffix in (".safetensors", ".bin", ".pt", ".gguf"):
        if any(f.endswith(suffix) and f not in NOT_WEIGHTS for f in top):
            return [*_HUB_SIDE_FILES, f"*{suffix}"]
    return list(_HUB_SIDE_FILES)


def cached_snapshot(model_id: str) -> Path | None:
    """The local snapshot of a hub id when the HF cache holds one (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def fetch_from_hub(model_id: str) -> Path:
    """The local snapshot of a hub id, downloaded once (with progress on stderr) when missing."""
    snapshot = cached_snapshot(model_id)
    if snapshot is not None and weight_files(snapshot):
        return snapshot
    cache = hub_cache_dir()
    if hub_offline():
        state = ("its cached snapshot holds no weights" if snapshot is not None
                 else f"not in the local HF cache ({cache})")
        raise HubUnreachable(model_id, f"{state} and HF_HUB_OFFLINE is set",
                             "download it where the hub is reachable (huggingface-cli download "
                             f"{model_id}) or give a local folder")
    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    log_once(f"model {model_id}: fetching from the Hugging Face hub into {cache} "
             "(once, before the first launch)")
    try:
        patterns = hub_weight_patterns(list_repo_files(model_id))
        path = Path(snapshot_download(model_id, cache_dir=cache, allow_patterns=patterns))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelNotFound(model_id, "no such repository on the Hugging Face hub, or it is gated "
                            f"({type(e).__name__})", "check the id; for a gated model accept its "
                            "licence and export HF_TOKEN") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ConnectionError) as e:
        raise _unreachable(model_id, cache, e) from e
    except Exception as e:
        # huggingface_hub lets httpx's own ConnectError / TimeoutException through
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
            raise _unreachable(model_id, cache, e) from e
        raise
    if not weight_files(path):
        raise ModelNotFound(model_id, f"the hub repository holds no weights vLLM loads ({path})")
    return path


def _unreachable(model_id: str, cache: Path, e: Exception) -> HubUnreachable:
    return HubUnreachable(model_id, f"not in the local HF cache ({cache}) and the hub cannot be "
                          f"reached ({type(e).__name__})", "download it where the hub is reachable "
                          f"(huggingface-cli download {model_id}) or give a local folder")


# ---------------------------------------------------------------- a study's model


def resolve_model(cfg, fetch: bool = True, quiet: bool = False) -> tuple[str, tuple[str, ...]]:
    """The model argument for vLLM and the study's fixed flags (with --load-format dummy where
    the model has no weights: presets and weightless folders, said once on stderr).

    A hub id resolves to its local snapshot, fetched now when `fetch` (before the first launch,
    outside any launch timeout), so it is sized and modelled like a folder. `fetch=False` (doctor)
    leaves an uncached hub id as it is.
    """
    model = cfg.model
    extra = list(cfg.extra_args)
    if model.startswith("preset:"):
        path, weightless = str(presets.preset_folder(model.split(":", 1)[1])), True
    else:
        local = Path(os.path.expanduser(model))
        looks_like_path = model.startswith(("/", "./", "../", "~")) or local.exists()
        if looks_like_path:
            # absolute (symlinks kept): the servers and best-command.sh (in results/NAME/) name
            # the folder wherever they run; the study keeps the path as given (`model_given`)
            path, weightless = _local(model, Path(os.path.abspath(local)))
        elif _HUB_ID.match(model):
            snapshot = fetch_from_hub(model) if fetch else cached_snapshot(model)
            if snapshot is None:
                return model, tuple(extra)
            path, weightless = _local(model, snapshot)
        else:
            raise ModelNotFound(model, "neither a folder nor an HF id",
                                "give a folder with config.json, an HF id (org/name) or preset:NAME")
    if getattr(cfg, "engine_name", "vllm") != "vllm":
        # another engine serves a weightless folder its own way (llama.cpp: a GGUF with random
        # weights written for it, tuner.engines.llamacpp_gguf) and takes no vLLM dtype flag
        if weightless and not quiet:
            log_once(f"model {model}: no weights in {path}: served with random weights")
        return path, tuple(extra)
    if weightless and "--load-format" not in extra:
        extra += ["--load-format", "dummy"]
        if not quiet:
            log_once(f"model {model}: no weights in {path}: served with --load-format dummy "
                     "(random weights; speed and memory are real, the text is not)")
    from tuner.run import devices

    gpus = devices.gpus(dict(cfg.env))
    extra += devices.dtype_flags(path, gpus[0] if gpus else None, extra)
    return path, tuple(extra)
