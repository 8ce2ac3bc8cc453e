"""Chat templates rendered as transformers renders them, without importing transformers.

A model's template (tokenizer_config.json, chat_template.jinja, GGUF metadata) is untrusted
Jinja code. It runs in jinja2's ImmutableSandboxedEnvironment with transformers' settings
(trim_blocks, lstrip_blocks, loopcontrols, the {% generation %} block) and the names transformers gives it:
raise_exception, strftime_now, a `tojson` that does not escape HTML, a `dict` and a
`namespace` that refuse underscore attributes, and the tokenizer's named special tokens
(bos_token, eos_token, ...) as variables. The messages are rebuilt from plain JSON types
before rendering, so a template cannot reach a caller's objects (or mutate its lists).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

# Names a message's reasoning is passed under; templates read the first (transformers' aliasing).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The template compiled in transformers' sandboxed environment (cached by its text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        # older releases have known sandbox escapes (transformers refuses them too)
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def plain_data(value):
    """`value` rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple); anything
    else becomes the placeholder "<TypeName>", as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template sees them: keys whose value is None dropped, plain data, and
    a reasoning field also given as reasoning_content and thinking."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_template(template: str, messages: list[dict], add_generation_prompt: bool = False,
                    special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, **kwargs) -> str:
    """One conversation rendered by `template`; `special_tokens` (bos_token, eos_token, ...) and
    kwargs become template variables (kwargs win)."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    variables = plain_data({**(special_tokens or {}), **kwargs})
    return compile_template(template).render(messages=template_messages(messages), tools=plain_data(tools),
                                             documents=plain_data(documents),
                                             add_generation_prompt=add_generation_prompt, **variables)
