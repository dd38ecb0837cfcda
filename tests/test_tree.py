"""Tree attention: each node's logits equal its branch run linearly, and the
compacted cache equals the cache of the linear run of the accepted path."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from freespec.draft import Draft
from freespec.engine import ModelTraits, compact_cache, make_cache, tree_forward
from freespec.tree import (ancestor_matrix, bfs_order, follow, node_depths, path_to, topological_order,
                           tree_attention)

from naive import naive_ancestors, naive_bfs, naive_depths


@st.composite
def parent_arrays(draw, max_nodes=12):
    n = draw(st.integers(0, max_nodes))
    return np.array([draw(st.integers(-1, i - 1)) for i in range(n)], np.int32)


@given(parent_arrays(), st.integers(1, 4), st.integers(0, 6))
def test_mask_matches_naive_definition(parents, num_pending, cache_len):
    mask, positions = tree_attention(parents, num_pending, cache_len)
    n = len(parents)
    depths = node_depths(parents)
    for q in range(num_pending + n):
        for k in range(cache_len + num_pending + n):
            if k < cache_len:
                expected = True
            elif k < cache_len + num_pending:
                expected = q >= k - cache_len if q < num_pending else True
            else:
                j = k - cache_len - num_pending
                expected = q >= num_pending and j in path_to(parents, q - num_pending)
            assert mask[q, k] == expected
    assert positions[:num_pending].tolist() == list(range(cache_len, cache_len + num_pending))
    assert positions[num_pending:].tolist() == (cache_len + num_pending - 1 + depths).tolist()


@given(parent_arrays(), st.integers(1, 5))
@settings(max_examples=50)
def test_sliding_window_masks_far_keys(parents, window):
    mask, positions = tree_attention(parents, 2, 7, sliding_window=window)
    full, _ = tree_attention(parents, 2, 7)
    key_pos = np.concatenate([np.arange(7), positions])
    assert np.array_equal(mask, full & (key_pos[None] > positions[:, None] - window))


@given(parent_arrays(max_nodes=40))
@settings(deadline=None)  # six Numba kernels per example: ~300 ms on a loaded 2-core machine
def test_tree_walks_match_their_twins(parents):
    assert node_depths(parents).tolist() == naive_depths(parents.tolist())
    assert ancestor_matrix(parents).tolist() == naive_ancestors(parents.tolist())
    assert bfs_order(parents).tolist() == naive_bfs(parents.tolist())
    assert topological_order(parents).tolist() == list(range(len(parents)))


@given(parent_arrays(max_nodes=12), st.randoms(use_true_random=False))
def test_topological_order_of_shuffled_trees(parents, rng):
    n = len(parents)
    perm = list(range(n))
    rng.shuffle(perm)  # node i of the tree is node new[i] of the shuffled array
    new = {old: i for i, old in enumerate(perm)}
    shuffled = [-1 if parents[old] < 0 else new[int(parents[old])] for old in perm]
    order = topological_order(shuffled).tolist()
    already_topological = all(p < i for i, p in enumerate(shuffled))
    assert order == (list(range(n)) if already_topological else naive_bfs(shuffled))
    assert sorted(order) == list(range(n))
    position = {node: k for k, node in enumerate(order)}
    assert all(p < 0 or position[p] < position[i] for i, p in enumerate(shuffled))


def test_tree_walks_examples_and_bad_input():
    assert bfs_order([-1, -1, 1, 0]).tolist() == [0, 1, 3, 2]
    assert topological_order([1, -1]).tolist() == [1, 0]
    assert follow([-1, 0, 0, 1], [5, 6, 8, 7], [5, 8, 9]) == [0, 2]
    assert follow([-1, 0, 0, 1], [5, 6, 8, 7], [5, 6, 7, 1]) == [0, 1, 3]
    assert follow([], [], [5]) == []
    for bad in ([0], [-2], [-1, 1]):
        with pytest.raises(ValueError, match="parents"):
            node_depths(bad)
    with pytest.raises(ValueError, match="tree"):
        topological_order([1, 0])


def test_ancestor_matrix_example():
    assert ancestor_matrix(np.array([-1, 0, 0, 2])).astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]


def _linear_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float32)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
def test_tree_logits_equal_linear_branches(which, request):
    model = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    committed = rng.integers(2, 120, 30).tolist()  # crosses gemma3's window of 8
    parents = np.array([-1, 0, 1, 0, -1, 4, 4, 6, 2, 8, 9, 10], np.int32)
    draft = Draft(rng.integers(2, 120, len(parents)), parents)
    traits = ModelTraits.of(model)
    cache = make_cache()
    with torch.no_grad():
        # prefill 25 tokens, then 5 pending + the tree, as a later step would
        tree_forward(model, traits, cache, 0, committed[:25], Draft.empty())
        logits = tree_forward(model, traits, cache, 25, committed[25:], draft)
    linear = _linear_logits(model, committed)
    assert torch.allclose(logits[0], linear[-1], atol=1e-8)
    for i in range(len(parents)):
        branch = [int(draft.token_ids[j]) for j in path_to(parents, i)]
        assert torch.allclose(logits[i + 1], _linear_logits(model, committed + branch)[-1], atol=1e-8), i


@pytest.mark.parametrize("accepted", [[], [0], [4, 5], [4, 6, 7], [0, 1, 2]])
def test_compacted_cache_equals_linear_cache(tiny_llama, accepted):
    model = tiny_llama
    rng = np.random.default_rng(1)
    committed = rng.integers(2, 120, 20).tolist()
    parents = np.array([-1, 0, 1, 0, -1, 4, 4, 6], np.int32)
    draft = Draft(rng.integers(2, 120, len(parents)), parents)
    cache = make_cache()
    with torch.no_grad():
        tree_forward(model, ModelTraits.of(model), cache, 0, committed, draft)
    compact_cache(cache, len(committed), accepted)
    path = committed + [int(draft.token_ids[i]) for i in accepted]
    reference = make_cache()
    with torch.no_grad():
        model(torch.tensor([path]), cache=reference, use_cache=True)
    for layer, ref in zip(cache.layers, reference.layers):
        assert layer.keys.shape == ref.keys.shape
        assert torch.allclose(layer.keys, ref.keys, atol=1e-9)
        assert torch.allclose(layer.values, ref.values, atol=1e-9)
