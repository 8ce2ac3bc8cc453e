"""Models named by a Hugging Face Hub id (``ORG/NAME[@REVISION]``), resolved to a local folder.

A path that exists always wins: ``--model my/model`` is the folder when there is one. Otherwise
a name of the Hub's shape is looked up through huggingface_hub: its cache first (``HF_HUB_CACHE``,
else ``HF_HOME/hub``), the Hub itself unless ``HF_HUB_OFFLINE`` is set. Every way this fails
(offline and not cached, gated, no such repo or revision, no network) is one UserError line that
says which and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hivetune.core.errors import UserError

# ORG/NAME with the Hub's characters, an optional @REVISION (branch, tag or commit).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# The files a model load reads: config, safetensors weights, tokenizer, chat template.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TRUE = ("1", "on", "yes", "true")


def split_hub_id(name: str) -> tuple[str, str | None] | None:
    """'ORG/NAME@REV' -> ('ORG/NAME', 'REV'); None for a name that is not of the Hub's shape."""
    match = HUB_ID.match(name)
    return (match["repo"], match["revision"]) if match else None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, not when huggingface_hub was imported."""
    return any(os.environ.get(k, "").strip().lower() in TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> str | None:
    """The Hub cache as the environment names it now (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def model_path(name: str | Path | None) -> Path:
    """The local path of --model: empty -> the embedded model; an existing path -> itself; a Hub
    id -> its snapshot folder in the cache (downloaded first when online); anything else -> the
    path as given (the loaders then say it is not found)."""
    from hivetune.core.embedded import embedded_model_path

    if not name:
        return embedded_model_path()
    path = Path(name)
    if path.exists() or str(name).lower().endswith(".gguf"):
        return path
    parts = split_hub_id(str(name))
    if parts is None:
        return path
    return hub_snapshot(*parts, repo_type="model", patterns=MODEL_FILES)


def hub_snapshot(repo: str, revision: str | None, repo_type: str = "model", patterns: list[str] | None = None) -> Path:
    """The folder of `repo` at `revision` in the Hub cache, fetched when online and missing."""
    # Function-local: huggingface_hub (and the HTTP stack under it) only for Hub ids.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = hub_offline()
    label = f"{repo}@{revision}" if revision else repo
    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        folder = snapshot_download(repo, revision=revision, repo_type=repo_type, cache_dir=hub_cache_dir(),
                                   allow_patterns=patterns, local_files_only=offline)
    except GatedRepoError:
        page = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo}"
        raise UserError(f"{label}: gated {kind} on the Hugging Face Hub; accept its terms at {page} "
                        "and log in (hf auth login or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{label}: no such {kind} on the Hugging Face Hub (a typo, or private: log in with "
                        "hf auth login); a local path is used when it exists") from None
    except RevisionNotFoundError:
        raise UserError(f"{label}: no revision {revision!r} of {repo} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        if offline:
            raise UserError(f"{label}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it "
                            f"once online (hf download {repo}{' --repo-type dataset' if kind == 'dataset' else ''}) "
                            "or pass a local path") from None
        raise UserError(f"{label}: not in the Hugging Face cache and the Hub cannot be reached; connect, or "
                        "pass a local path") from None
    except (HfHubHTTPError, OSError) as e:
        raise UserError(f"{label}: the Hugging Face Hub failed ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    return Path(folder)


def base_model_name(name: str, path: Path) -> str:
    """What an adapter records as its base (PEFT's base_model_name_or_path): the Hub id when the
    model came from the Hub, so that PEFT and `hivetune export` find it on any machine; else the path."""
    return name if name and split_hub_id(name) and not Path(name).exists() else str(path)
