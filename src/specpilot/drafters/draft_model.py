"""A smaller model with the target's tokenizer drafts greedily, k tokens per cycle.

The drafter keeps its own KV cache. Instead of being told what was accepted, it compares the
context it is given with the tokens it fed last time and rolls its cache back to the common
prefix (free, see ``KVCache``), then feeds the new tail (usually the bonus token, or one
accepted draft plus the bonus) and drafts from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpilot.drafters.base import DraftProposal
from specpilot.drafters.tree import TreeNode, TreeProposal, TreeShape, empty_trees, pack_trees
from specpilot.errors import IncompatibleDrafterError
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer


def check_draft_model(model: Transformer, k: int, target_vocab_size: int | None) -> None:
    """The checks every draft-model drafter (eager or CUDA-graph) makes on construction."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if target_vocab_size is not None and model.cfg.vocab_size != target_vocab_size:
        raise IncompatibleDrafterError(
            f"The drafter's vocabulary has {model.cfg.vocab_size} tokens but the target's has "
            f"{target_vocab_size}; a draft model must share the target's tokenizer."
        )


class DraftModelDrafter:
    name = "draft-model"

    def __init__(
        self, model: Transformer, k: int = 5, target_vocab_size: int | None = None
    ) -> None:
        check_draft_model(model, k, target_vocab_size)
        self.model = model
        self.k = k
        self._cache: KVCache | None = None
        self._fed: list[list[int]] = []  # per row: the tokens whose KV is in the cache
        self._room = k  # slots needed past the context per call (k, or a tree's node count)

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        need = max(len(c) for c in contexts) + 4 * self._room + 8
        b = len(contexts)
        cache = self._cache
        if cache is None or cache.batch_size != b or cache.max_seq_len < need:
            cache = self.model.allocate_cache(b, max(need, 256))
        cache.reset()
        self._cache = cache
        self._fed = [[] for _ in contexts]

    def reset_row(self, row: int) -> None:
        """Nothing to forget: ``_feed`` keeps the KV of the longest prefix the new sequence shares
        with what the slot fed before (a K/V entry depends only on the tokens up to it), and
        recomputes the rest."""

    def ensure_capacity(self, max_context: int) -> None:
        """Grow the cache (copying nothing: the drafter re-prefills) if a context outgrows it."""
        if self._cache is not None and max_context + self._room + 2 > self._cache.max_seq_len:
            self._cache = None
            self._fed = [[] for _ in self._fed]

    def _feed(self, contexts: Sequence[Sequence[int]]) -> Tensor:
        """Reconcile the cache with ``contexts``, feed the new tails; logits ``[B, 1, V]`` after each."""
        self.ensure_capacity(max(len(c) for c in contexts))
        if self._cache is None:
            self.start(contexts)
        cache = self._cache
        assert cache is not None
        dev = self.model.device
        b = len(contexts)
        tails: list[list[int]] = []
        for row, ctx in enumerate(contexts):
            fed = self._fed[row]
            common = 0
            limit = min(len(fed), len(ctx))
            while common < limit and fed[common] == ctx[common]:
                common += 1
            if common == len(ctx):  # the whole context was fed: re-feed its last token
                common -= 1
            cache.commit(row, common)
            self._fed[row] = list(ctx[:common])
            tails.append(list(ctx[common:]))

        width = max(len(t) for t in tails)
        chunk = torch.zeros(b, width, dtype=torch.int64)
        for row, tail in enumerate(tails):
            chunk[row, : len(tail)] = torch.tensor(tail, dtype=torch.int64)
        last = torch.tensor([len(t) - 1 for t in tails], dtype=torch.int64, device=dev)[:, None]
        logits = self.model(chunk.to(dev), cache, logits_rows=last).logits  # [B, 1, V]
        for row, tail in enumerate(tails):
            cache.commit(row, int(cache.lengths[row]) + len(tail))
            self._fed[row].extend(tail)
        return logits

    @torch.inference_mode()
    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        logits = self._feed(contexts)  # [B, 1, V]
        cache = self._cache
        assert cache is not None
        dev = self.model.device
        b = len(contexts)
        steps = min(self.k, max(max_lens)) if max_lens else self.k
        drafts = torch.zeros(b, max(steps, 0), dtype=torch.int64, device=dev)
        for i in range(steps):
            nxt = logits[:, -1].argmax(dim=-1)  # [B]
            drafts[:, i] = nxt
            if i + 1 < steps:
                logits = self.model(nxt[:, None], cache).logits  # [B, 1, V]
                cache.lengths += 1
        fed_drafts = drafts[:, : max(steps - 1, 0)].tolist()
        for row in range(b):
            self._fed[row].extend(fed_drafts[row])
        lengths = [max(0, min(steps, m)) for m in max_lens]
        return DraftProposal(tokens=drafts, lengths=lengths)

    @torch.inference_mode()
    def propose_tree(
        self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int], shape: TreeShape
    ) -> TreeProposal:
        """Top-``branch`` children per frontier node, the best ``widths[d]`` kept per depth.

        Nodes are ranked by the drafter's cumulative log-probability along their path (ties: the
        earlier parent, then the likelier token). Each depth is one forward of the draft model over
        every node so far (tree mask, positions by depth), reading logits at the frontier only; the
        tree's KV is never committed, so the next call starts from the context again.
        """
        b = len(contexts)
        depth = min(shape.depth, max(max_lens, default=0))
        if depth <= 0:
            return empty_trees(b)
        self._room = max(self.k, shape.max_nodes)  # the tree's nodes sit past the context
        logits = self._feed(contexts)[:, 0].float()  # [B, V]
        cache = self._cache
        assert cache is not None
        dev = self.model.device
        rows: list[list[TreeNode]] = [[] for _ in range(b)]
        scores: list[list[float]] = [[] for _ in range(b)]
        frontier: list[list[int]] = [[-1] for _ in range(b)]  # node ids whose children come next
        front_logits = logits[:, None, :]  # [B, F, V]
        for d in range(1, depth + 1):
            logp = torch.log_softmax(front_logits, dim=-1)  # [B, F, V]
            top_lp, top_tok = logp.topk(shape.branch, dim=-1)  # [B, F, branch]
            top_lp_l, top_tok_l = top_lp.tolist(), top_tok.tolist()
            new_frontier: list[list[int]] = [[] for _ in range(b)]
            for row in range(b):
                room = min(shape.widths[d - 1], shape.max_nodes - len(rows[row]))
                if d > max_lens[row] or room <= 0:
                    continue
                cands = []
                for f, parent in enumerate(frontier[row]):
                    base = scores[row][parent] if parent >= 0 else 0.0
                    for j in range(shape.branch):
                        cands.append((base + top_lp_l[row][f][j], f, j, parent))
                cands.sort(key=lambda c: (-c[0], c[1], c[2]))
                for score, f, j, parent in cands[:room]:
                    node = len(rows[row])
                    rows[row].append(TreeNode(token=top_tok_l[row][f][j], parent=parent, depth=d))
                    scores[row].append(score)
                    if parent >= 0:
                        rows[row][parent].children.append(node)
                    new_frontier[row].append(node)
            frontier = new_frontier
            if d == depth or not any(frontier):
                break
            front_logits = self._tree_logits(rows, frontier, cache, dev)
        return pack_trees(rows)

    def _tree_logits(
        self,
        rows: list[list[TreeNode]],
        frontier: list[list[int]],
        cache: KVCache,
        dev: torch.device,
    ) -> Tensor:  # [B, F, V] float32 logits at the frontier nodes (padded rows repeat node 0)
        """One draft forward over every node so far, attending to ancestors only."""
        b = len(rows)
        n = max(len(r) for r in rows)
        f = max(max(len(fr) for fr in frontier), 1)
        tokens = torch.zeros(b, n, dtype=torch.int64)
        positions = torch.zeros(b, n, dtype=torch.int64)
        mask = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)  # [B, N, N]
        rows_out = torch.zeros(b, f, dtype=torch.int64)
        for row, nodes in enumerate(rows):
            base = int(cache.lengths[row]) - 1  # position of depth 1 = len(context)
            for i, nd in enumerate(nodes):
                tokens[row, i] = nd.token
                positions[row, i] = base + nd.depth
                if nd.parent >= 0:
                    mask[row, i] |= mask[row, nd.parent]
            for j, node in enumerate(frontier[row]):
                rows_out[row, j] = node
        logits = self.model(
            tokens.to(dev),
            cache,
            positions=positions.to(dev),
            tree_mask=mask.to(dev),
            logits_rows=rows_out.to(dev),
        ).logits  # [B, F, V]
        return logits.float()
