"""TokenTree invariants (hypothesis): depths, paths and masks agree; a walk appends the target's samples
along one root-to-node path and stops at the first row whose sample no child carries; a chain's walk is
the chain rule: drafts while each equals the sample at its row, then the first mismatch or the bonus."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.proposers.token_tree import TokenTree


@st.composite
def trees(draw, max_nodes: int = 12, vocab: int = 4):
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
    return TokenTree(tokens, parents)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(tree=trees())
def test_depths_paths_and_masks_agree(tree):
    mask = tree.mask()
    for i in range(len(tree.tokens)):
        path = tree.path(i)
        assert path[-1] == i and len(path) == tree.depths[i]
        assert tree.parents[path[0]] == -1
        assert all(tree.parents[b] == a for a, b in itertools.pairwise(path))
        assert np.flatnonzero(mask[i]).tolist() == sorted(path)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(tree=trees(), data=st.data())
def test_a_walk_appends_samples_along_one_path_and_stops_where_no_child_matches(tree, data):
    samples = data.draw(st.lists(st.integers(0, 3), min_size=len(tree.tokens) + 1,
                                 max_size=len(tree.tokens) + 1))
    tokens, rows = tree.walk(samples)
    assert tokens == [samples[r] for r in rows] and rows[0] == 0
    nodes = [r - 1 for r in rows[1:]]  # the accepted drafts' nodes
    assert nodes == (tree.path(nodes[-1]) if nodes else [])
    assert [tree.tokens[n] for n in nodes] == tokens[:-1]  # each accepted draft is the sample before it
    last = rows[-1] - 1
    assert tokens[-1] not in {t for t, p in zip(tree.tokens, tree.parents) if p == last}


@settings(max_examples=200, derandomize=True, deadline=None)
@given(drafts=st.lists(st.integers(0, 3), max_size=8), data=st.data())
def test_a_chains_walk_is_the_chain_verification(drafts, data):
    samples = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    tree = TokenTree.chain(drafts)
    assert tree.is_chain and tree.depths == tuple(range(1, len(drafts) + 1))
    expected = []
    for draft, sample in zip(drafts, samples):
        expected.append(sample)
        if sample != draft:
            break
    else:
        expected.append(samples[len(drafts)])
    assert tree.walk(samples)[0] == expected


@pytest.mark.parametrize("tokens, parents, message", [
    ((1, 2), (-1,), "2 tokens but 1 parents"),
    ((1, 2), (-1, 1), "node 1's parent 1 is not an earlier node"),
    ((1,), (-2,), "node 0's parent -2"),
])
def test_a_malformed_tree_is_refused_naming_the_node(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents)


@st.composite
def ranked_trees(draw, max_nodes: int = 14):
    """Trees whose siblings carry distinct tokens, ranked in their order (as a drafter's top-k)."""
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    vocab = max_nodes + 1
    # per parent (+1: the root)
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=n + 1, max_size=n + 1))
    ranks = tuple(parents[:i].count(p) for i, p in enumerate(parents))
    tokens = tuple((base[p + 1] + r) % vocab for p, r in zip(parents, ranks))
    return TokenTree(tokens, parents, ranks)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(tree=ranked_trees(), data=st.data())
def test_kept_by_width_is_what_each_narrowed_tree_keeps(tree, data):
    depth = max(tree.depths, default=0)
    truth = data.draw(st.lists(st.integers(0, 14), min_size=depth + 1, max_size=depth + 1))
    kept = tree.kept_by_width(truth, 4)
    for width in range(1, 5):
        narrow = tree.narrowed(width)
        assert all(r < width for r in narrow.ranks)
        assert all(p < 0 or narrow.ranks[p] < width for p in narrow.parents)
        # the target samples truth[d] at a row of depth d (the root's is 0), whatever was drafted
        samples = [truth[0], *(truth[d] for d in narrow.depths)]
        tokens, _ = narrow.walk(samples)
        assert len(tokens) - 1 == kept[width - 1]
    assert kept == sorted(kept)  # a wider tree holds every narrower one
    assert tree.narrowed(len(tree.tokens) + 1) == tree
