"""Mistral's sliding window in GGUF: llama.cpp writes Mistral as its llama architecture, whose graph
has no window (and it turns Phi-3's off), so past the window its attention is not the model's. The
export writes the window as the context length and says so in one line; inside it llama.cpp's
logits and greedy tokens equal hivetune's, past it they do not (the reason for the cut)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from test_export import VOCAB, make_run, reference_logits, rel_diff

from hivetune.model.config import ModelArgs
from hivetune.model.gguf_write import gguf_context_length, window_note
from hivetune.model.load import open_gguf
from hivetune.workflows.export import export

WINDOW = 16
NOTE = ("hivetune: export: mistral's sliding window of 16 tokens is not run by llama.cpp's llama graph: the GGUF's "
        "context length is 16, not 2048; longer texts answer differently in llama.cpp")


@pytest.fixture(scope="module")
def mistral_export(tmp_path_factory):
    """A tiny Mistral run (window 16, context 2048) exported as f32 GGUF, and the export's stderr."""
    root = tmp_path_factory.mktemp("export-mistral")
    base, run = make_run(root, "mistral", sliding_window=WINDOW, max_position_embeddings=2048)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        export(run, "gguf", root / "gguf", dtype="f32")
    return base, run, root / "gguf", err.getvalue()


def test_mistral_export_writes_the_window_as_context_and_says_so(mistral_export):
    base, run, out, err = mistral_export
    assert err.splitlines().count(NOTE) == 1
    fields = open_gguf(out / "model-f32.gguf").fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.context_length"].contents() == WINDOW
    assert "llama.attention.sliding_window" not in fields  # llama.cpp's llama graph has no such key
    assert f"--jinja -c {WINDOW} --port 8080" in (out / "llama-server.sh").read_text()


def test_llama_cpp_equals_hivetune_inside_the_window_only(mistral_export):
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or an OSError from a broken shared library
        pytest.skip(f"llama-cpp-python cannot be imported ({type(e).__name__})")
    base, run, out, _ = mistral_export
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(7))
    ref = reference_logits(base, run, ids)[0]  # hivetune's Mistral, window and all
    llm = llama_cpp.Llama(model_path=str(out / "model-f32.gguf"), n_ctx=64, n_threads=2, type_k=0, type_v=0,
                          logits_all=True, verbose=False)
    try:
        assert llm._model.n_ctx_train() == WINDOW  # the context llama.cpp warns past
        llm.eval(ids[0].tolist())
        theirs = torch.from_numpy(np.array(llm.scores[:ids.shape[1]]))
    finally:
        llm.close()
    inside, past = rel_diff(theirs[:WINDOW], ref[:WINDOW]), rel_diff(theirs[WINDOW:], ref[WINDOW:])
    print(f"rel diff inside the window {inside:.3g}, past it {past:.3g}")
    assert inside <= 1e-4
    assert past > 1e-2  # past it llama.cpp attends to every key


def test_window_note_names_what_llama_cpp_does_not_run():
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096)
    phi3 = ModelArgs.from_hf_dict(dict(base, model_type="phi3", sliding_window=2047))
    assert gguf_context_length(phi3) == 2047
    assert window_note(phi3) == ("phi3's sliding window of 2047 tokens is not run by llama.cpp's phi3 graph: the "
                                 "GGUF's context length is 2047, not 4096; longer texts answer differently in "
                                 "llama.cpp")
    # a window no shorter than the context, or one llama.cpp runs (Gemma's), changes nothing
    for args in (ModelArgs.from_hf_dict(dict(base, model_type="mistral", sliding_window=4096)),
                 ModelArgs.from_hf_dict(dict(base, model_type="mistral")),
                 ModelArgs.from_hf_dict(dict(base, model_type="gemma2", head_dim=16, sliding_window=8,
                                             query_pre_attn_scalar=16))):
        assert (gguf_context_length(args), window_note(args)) == (4096, None)
