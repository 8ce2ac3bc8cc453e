"""An HF folder's tokenizer from tokenizer.json and tokenizer_config.json, built with the
`tokenizers` library alone (no transformers import: its tokenizer classes bring torch._dynamo,
scikit-learn and pyarrow, seconds of start-up; docs/log.md).

It builds what transformers' generic fast tokenizer (TokenizersBackend, PreTrainedTokenizerFast)
builds from the same files: tokenizer.json as written; the named special tokens (bos, eos, unk,
sep, pad, cls, mask, model-specific *_token keys) and extra special tokens from the config
(special_tokens_map.json for older folders), each added to the vocabulary when missing; the
config's added_tokens_decoder; the post-processor of tokenizer.json (transformers ignores
add_bos_token / add_eos_token there); the chat template from chat_template.jinja (and
additional_chat_templates/) or the config. It exposes the part of transformers' tokenizer
interface that hivetune uses (tests/model/test_folder_tokenizer.py checks it against
transformers).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def read_json(path: Path) -> dict:
    from hivetune.core.errors import UserError

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def added_token(value):
    """An AddedToken from tokenizer_config's dict form ({"content": ..., "lstrip": ...}), else the value."""
    from tokenizers import AddedToken

    if isinstance(value, dict) and "content" in value:
        return AddedToken(**{k: value[k] for k in ADDED_TOKEN_FIELDS if k in value})
    return value


def folder_chat_template(folder: Path, config: dict):
    """chat_template.jinja (with additional_chat_templates/*.jinja: a dict by name, the file's as
    "default"), else the config's chat_template (a list of {name, template} becomes a dict)."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class FolderTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens, chat template and call conventions of
    transformers' fast tokenizer: `tok(text)["input_ids"]`, `decode`, `apply_chat_template`."""

    is_fast = True

    def __init__(self, folder: str | Path):
        from tokenizers import AddedToken, Tokenizer, processors

        folder = Path(folder)
        self.name_or_path = str(folder)
        config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
        self.config = config
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend.no_truncation()  # transformers' __call__ turns both off unless asked
        backend.no_padding()
        config_added = {int(i): added_token(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
        specials = {k: config[k] for k in NAMED_TOKENS if config.get(k) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):
            specials.update(extra)
            extra = []
        specials.update({k: v for k, v in config.items()
                         if k not in NAMED_TOKENS and k.endswith("_token") and isinstance(v, str)})
        if "added_tokens_decoder" not in config and (folder / "special_tokens_map.json").exists():
            for key, value in read_json(folder / "special_tokens_map.json").items():
                if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                    extra = list(extra) + [v for v in value if v not in extra]
                elif isinstance(value, (str, dict)):
                    specials[key] = ({**value, "special": True} if isinstance(value, dict) else value)
        by_content = {str(t): t for t in config_added.values()}
        self._specials = {k: by_content.get(str(added_token(v)), added_token(v)) for k, v in specials.items()}
        self._extra = [added_token(t) for t in extra]
        # Tokens the config names that the vocabulary lacks are added (special ones as special).
        have = {repr(t) for t in backend.get_added_tokens_decoder().values()}
        to_add = [t for _, t in sorted(config_added.items()) if repr(t) not in have]
        known = {str(t) for t in backend.get_added_tokens_decoder().values()} | {str(t) for t in to_add}
        for token in [*self._specials.values(), *self._extra]:
            if str(token) not in known and token not in to_add:
                to_add.append(token)
        named = {str(t) for t in self._specials.values()}
        fixed = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            fixed.append(token)
        if fixed:
            backend.add_tokens(fixed)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._tokenizer = backend
        # transformers drops add_bos_token / add_eos_token when tokenizer.json exists (its
        # post-processor decides); a tokenizer.json without one gets an empty template.
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        self.chat_template = folder_chat_template(folder, config)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def from_pretrained(cls, folder: str | Path, **_ignored) -> "FolderTokenizer":
        return cls(folder)

    # ------------------------------------------------------------------ vocabulary
    @property
    def backend_tokenizer(self):
        return self._tokenizer

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    def convert_tokens_to_ids(self, tokens):
        """The id of a token (the unk id when it is not in the vocabulary), or a list of them."""
        if isinstance(tokens, str):
            i = self._tokenizer.token_to_id(tokens)
            return i if i is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    # ------------------------------------------------------------------ special tokens
    def _special(self, name: str) -> str | None:
        value = self._specials.get(name)
        return None if value is None else str(value)

    def _special_id(self, name: str) -> int | None:
        token = self._special(name)
        if token is None:
            return None
        i = self._tokenizer.token_to_id(token)
        if i is None and name != "unk_token":
            return self._special_id("unk_token")
        return i

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (standard ones first, then the model-specific *_token keys)."""
        order = [*NAMED_TOKENS, *(k for k in self._specials if k not in NAMED_TOKENS)]
        return {k: str(self._specials[k]) for k in order if self._specials.get(k) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *(str(t) for t in self._extra)]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ------------------------------------------------------------------ encode / decode
    def __call__(self, text, add_special_tokens: bool = True, return_offsets_mapping: bool = False, **_ignored):
        """{"input_ids", "attention_mask"[, "offset_mapping"]} of a string, or of each of a list of strings."""
        batch = not isinstance(text, str)
        encodings = (self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens) if batch
                     else [self._tokenizer.encode(text, add_special_tokens=add_special_tokens)])
        out = {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings]}
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encodings]
        return out if batch else {k: v[0] for k, v in out.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self._tokenizer.model).__name__ != "BPE":  # transformers skips BPE models
            text = clean_up_tokenization(text)
        return text

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """transformers' choice: a named template of a dict (tool_use with tools, else default), or the one."""
        if isinstance(self.chat_template, dict):
            if chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.chat_template:
                    return self.chat_template["tool_use"]
                if "default" in self.chat_template:
                    return self.chat_template["default"]
                raise ValueError("This model has multiple chat templates with no default specified; available: "
                                 f"{sorted(self.chat_template)}")
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation: list[dict], tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs):
        """The conversation rendered by the chat template; tokenized (without special tokens) unless tokenize=False."""
        from hivetune.model.chat_template import render_template

        text = render_template(self.get_chat_template(chat_template, tools), conversation, add_generation_prompt,
                               self.special_tokens_map, tools=tools, documents=documents, **kwargs)
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    # ------------------------------------------------------------------ save
    def save_pretrained(self, folder: str | Path) -> tuple[str, ...]:
        """tokenizer.json, tokenizer_config.json (the loaded config, its chat template included) and
        chat_template.jinja when there is one template, as transformers writes them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(folder / "tokenizer.json"))
        config = copy.deepcopy(self.config)
        config.setdefault("tokenizer_class", "TokenizersBackend")
        config.pop("chat_template", None)
        names = [str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")]
        if isinstance(self.chat_template, str):
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
            names.append(str(folder / "chat_template.jinja"))
        elif isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")
        return tuple(names)

    def __repr__(self) -> str:
        return f"FolderTokenizer({self.name_or_path!r}, vocab={len(self)})"
