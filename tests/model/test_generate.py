"""generate(): the jitted fixed-buffer loop against a plain Python loop over model(...)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train.families import get_model_config
from mlir_train.data import load_tokenizer
from mlir_train.data.config import DEFAULT_TOKENIZER
from mlir_train.model.generate import generate
from mlir_train.families import init_model
from mlir_train.model import ModelOptions, logical_axes

TINY = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2)
PROMPTS = [[5, 17, 300, 42, 7, 99, 1, 250], [3], [400, 401, 402, 11]]


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=0)


def _greedy_reference(model, prompt, n):
    """Plain Python loop over ``model(ids)``, no segment ids: one jitted fixed-length forward
    (the causal mask makes the zeros after the last token irrelevant), argmax, append."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    ids = np.zeros((1, len(prompt) + n), np.int32)
    ids[0, : len(prompt)] = prompt
    for pos in range(len(prompt), len(prompt) + n):
        logits = forward(state, jnp.asarray(ids))
        ids[0, pos] = int(jnp.argmax(logits[0, pos - 1]))
    return [int(t) for t in ids[0, len(prompt):]]


def test_greedy_equals_step_by_step_argmax(model):
    got = generate(model, None, [PROMPTS[0]], max_new_tokens=6)
    assert got[0].tokens == _greedy_reference(model, PROMPTS[0], 6)
    assert got[0].text is None and not got[0].stopped_at_eos


def test_batch_of_different_lengths_equals_each_alone(model):
    batch = generate(model, None, PROMPTS, max_new_tokens=6)
    alone = [generate(model, None, [p], max_new_tokens=6)[0] for p in PROMPTS]
    assert [g.tokens for g in batch] == [g.tokens for g in alone]
    assert all(len(g.tokens) == 6 for g in batch)


def test_eos_stops_only_its_row(model):
    free = generate(model, None, PROMPTS, max_new_tokens=6)
    eos = free[0].tokens[2]  # row 0's third new token
    got = generate(model, None, PROMPTS, max_new_tokens=6, eos_token_id=eos)
    for g, f in zip(got, free):
        if eos in f.tokens:
            cut = f.tokens.index(eos)
            assert g.tokens == f.tokens[:cut] and g.stopped_at_eos
        else:
            assert g.tokens == f.tokens and not g.stopped_at_eos
    assert got[0].tokens == free[0].tokens[: free[0].tokens.index(eos)]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    kw = dict(max_new_tokens=6, temperature=1.0)
    a = generate(model, None, PROMPTS, seed=1, **kw)
    b = generate(model, None, PROMPTS, seed=1, **kw)
    c = generate(model, None, PROMPTS, seed=2, **kw)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    # A random-init model is close to uniform over 512 tokens: two seeds disagree somewhere.
    assert [g.tokens for g in a] != [g.tokens for g in c]
    greedy = generate(model, None, PROMPTS, max_new_tokens=6)
    top1 = generate(model, None, PROMPTS, top_k=1, seed=3, **kw)
    tiny_p = generate(model, None, PROMPTS, top_p=1e-6, seed=3, **kw)
    assert [g.tokens for g in top1] == [g.tokens for g in greedy] == [g.tokens for g in tiny_p]


def test_string_prompts_with_tokenizer(model):
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    hello = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert max(hello) < TINY.vocab_size  # the tiny model's ids are valid tokenizer ids too
    got = generate(model, tokenizer, ["Hello world", *PROMPTS[1:]], max_new_tokens=6)
    want = generate(model, None, [hello, *PROMPTS[1:]], max_new_tokens=6, eos_token_id=tokenizer.eos_token_id)
    assert [g.tokens for g in got] == [g.tokens for g in want]
    for g in got:
        assert g.text == tokenizer.decode(g.tokens, skip_special_tokens=True)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, None, ["text"], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, None, PROMPTS, max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, None, PROMPTS, max_new_tokens=TINY.max_position_embeddings)
    assert generate(model, None, [], max_new_tokens=2) == []


def test_sharded_model_under_the_trainer_mesh_gives_the_same_answers(model):
    # The trainer asks for its before/after answers with the model sharded and its rules active.
    from sharding import Layout, make_mesh, rules_for, tree_shardings, use_rules

    parallel = Layout(tensor=2, expert=2)
    mesh = make_mesh(parallel)
    rules = rules_for(parallel, {"num_kv_heads": TINY.num_kv_heads})
    with jax.set_mesh(mesh), use_rules(rules):
        shardings = tree_shardings(logical_axes(model), rules, mesh)
        sharded = init_model(TINY, seed=0, shardings=shardings)
        got = generate(sharded, None, PROMPTS, max_new_tokens=6)
    assert [g.tokens for g in got] == [g.tokens for g in generate(model, None, PROMPTS, max_new_tokens=6)]
