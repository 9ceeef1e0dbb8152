"""A depth-limited suffix tree over several token sequences, with counts: the structure of
suffix decoding (Arctic Inference's SuffixTree, csrc/suffix_decoding/suffix_tree.cc, which
vLLM's method "suffix" runs), written here in Python.

What it represents: every suffix of every sequence, cut to `max_depth` tokens, as a path from
the root. The count of a path s is the number of places s occurs (|s| <= max_depth) in the
sequences; count(s + t) / count(s) is the estimated probability that t follows s. Paths are
compressed: a node holds a run of tokens that all have the same count, read from one of the
sequences (`seq`, `start`, `length`) rather than copied, so the tree has O(tokens) nodes.
Appending a token extends the at most max_depth suffixes still shorter than max_depth
(O(max_depth) per token); removing a sequence walks its suffixes once.

Invariants the code keeps: every suffix ends at the end of a node; a node's (seq, start)
points at an occurrence of the whole path from the root to it; `best` is the child with the
highest count, ties to the smallest token (the fixed rule every rank applies alike).
"""
from __future__ import annotations

import collections


class _Node:
    __slots__ = ("count", "parent", "children", "best", "seq", "start", "length", "ends")

    def __init__(self, count, parent, seq, start, length):
        self.count = count  # suffixes that pass through or end at this node
        self.parent = parent
        self.children: dict[int, _Node] | None = None  # keyed by the child's first token
        self.best: _Node | None = None
        self.seq = seq
        self.start = start
        self.length = length
        # with removal tracked: {sequence id: end index} of suffixes ending here
        self.ends: dict | None = None


class SuffixTree:
    def __init__(self, max_depth: int, removable: bool = False):
        self.max_depth = max_depth
        # `removable`: sequences can be removed (remembers where suffixes end, to re-point
        # nodes that read their tokens from the removed sequence)
        self.removable = removable
        self.root = _Node(0, None, None, 0, 0)
        self.seqs: dict[object, list[int]] = {}
        # per sequence, the nodes where its suffixes shorter than max_depth end, oldest first
        self._active: dict[object, collections.deque] = {}

    def _first(self, node: _Node) -> int:
        return self.seqs[node.seq][node.start]

    # ---- adding ---------------------------------------------------------------------

    def extend(self, sid, tokens) -> None:
        if sid not in self.seqs:
            self.seqs[sid] = []
            self._active[sid] = collections.deque()
        for token in tokens:
            self._append(sid, token)

    def _append(self, sid, token: int) -> None:
        toks = self.seqs[sid]
        end = len(toks)  # the new token's index
        toks.append(token)
        active = self._active[sid]
        active.append(self.root)  # the suffix starting at the new token
        self.root.count += 1
        if len(active) > self.max_depth:
            active.popleft()  # max_depth long: it stays where it ends
        removable, root = self.removable, self.root
        for i, node in enumerate(active):
            if node.count == 1 and not node.children and node is not root:
                # a leaf only this suffix reaches (the common case) grows in place
                node.length += 1
                if removable:
                    node.ends[sid] = end + 1
            else:
                active[i] = self._extend_suffix(node, sid, end, token)

    def _extend_suffix(self, node: _Node, sid, end: int, token: int) -> _Node:
        """A suffix of `sid` ending at `node` (just before index `end`) takes `token`;
        returns the node where it ends now."""
        child = node.children.get(token) if node.children else None
        if child is None:  # (a leaf only this suffix reaches grew in _append)
            new = _Node(1, node, sid, end, 1)
            if node.children is None:
                node.children = {}
            node.children[token] = new
            self._better(node, new)
            self._move_end(node, new, sid, end + 1)
            return new
        if node is not self.root and node.count == child.count + 1:
            # every other suffix through `node` goes on into `child`: after this token all of
            # them do, so the token joins `node` (whose count it now has)
            return self._absorb_first(node, child, sid, end)
        if child.length > 1:  # the suffix ends after the child's first token: split it
            child = self._split(node, child)
        child.count += 1
        child.seq, child.start = sid, end
        self._better(node, child)
        self._move_end(node, child, sid, end + 1)
        return child

    def _absorb_first(self, node: _Node, child: _Node, sid, end: int) -> _Node:
        """`node`'s only continuation is `child`, and the suffix ending at `node` takes
        child's first token: that token moves into `node` (or, a one-token child, the two
        nodes become one)."""
        if child.length == 1:
            parent, parent_key = node.parent, self._first(node)
            child.parent = parent
            child.length += node.length
            child.count = node.count
            child.seq, child.start = sid, end + 1 - child.length
            parent.children[parent_key] = child
            if parent.best is node:
                parent.best = child
            # `node` goes; only this suffix ended there (the counts say so)
            self._set_end(child, sid, end + 1)
            return child
        del node.children[self._first(child)]
        node.length += 1
        node.seq, node.start = sid, end + 1 - node.length
        child.length -= 1
        child.start += 1
        node.children[self._first(child)] = child
        self._set_end(node, sid, end + 1)
        return node

    def _split(self, node: _Node, child: _Node) -> _Node:
        """Cut `child` after its first token; the new one-token node takes its place."""
        head = _Node(child.count, node, child.seq, child.start, 1)
        key = self._first(child)
        child.parent = head
        child.start += 1
        child.length -= 1
        head.children = {self._first(child): child}
        head.best = child
        node.children[key] = head
        if node.best is child:
            node.best = head
        return head

    def _better(self, node: _Node, child: _Node) -> None:
        """`child`'s count rose: is it `node`'s best continuation now?"""
        best = node.best
        if (best is None or child.count > best.count
                or (child.count == best.count and self._first(child) < self._first(best))):
            node.best = child

    def _set_end(self, node: _Node, sid, end: int) -> None:
        if self.removable:
            if node.ends is None:
                node.ends = {}
            node.ends[sid] = end

    def _move_end(self, old: _Node, new: _Node, sid, end: int) -> None:
        if self.removable:
            if old.ends:
                old.ends.pop(sid, None)
            self._set_end(new, sid, end)

    # ---- removing -------------------------------------------------------------------

    def remove(self, sid) -> None:
        """Takes every suffix of `sid` out; nodes that read their tokens from it are
        pointed at another occurrence, and runs left with one continuation of the same
        count are joined again."""
        assert self.removable
        toks = self.seqs[sid]
        touched: dict[_Node, int] = {}  # surviving nodes on sid's paths -> their depth
        for start in range(len(toks)):
            self._remove_suffix(sid, toks, start, touched)
        del self._active[sid]
        alive = [node for node in touched if self._alive(node)]
        deepest_first = sorted(alive, key=touched.get, reverse=True)
        for node in deepest_first:
            if node.seq == sid:
                self._repoint(node, sid)
        del self.seqs[sid]
        for node in deepest_first:
            self._rebest(node)
        for node in deepest_first:
            self._maybe_join(node)

    def _remove_suffix(self, sid, toks, start: int, touched: dict) -> None:
        node, at = self.root, start
        node.count -= 1
        stop = min(start + self.max_depth, len(toks))
        while at < stop:
            child = node.children[toks[at]]
            child.count -= 1
            if child.count == 0:  # nothing else goes this way: drop the branch
                del node.children[toks[at]]
                child.parent = None
                if node.best is child:
                    node.best = None
                touched.setdefault(node, at - start)
                return
            at += child.length
            touched.setdefault(child, at - start)
            node = child
        if node.ends:
            node.ends.pop(sid, None)

    def _alive(self, node: _Node) -> bool:
        """Still in the tree (not in a branch dropped or joined away)?"""
        while node is not self.root:
            if node.parent is None:
                return False
            node = node.parent
        return True

    def _repoint(self, node: _Node, sid) -> None:
        """`node` reads from `sid`, which is going: read from another occurrence of its
        path, found at a child (already re-pointed: deeper first) or a suffix ending here."""
        for child in (node.children or {}).values():
            if child.seq != sid:
                node.seq, node.start = child.seq, child.start - node.length
                return
        for other, end in (node.ends or {}).items():
            if other != sid:
                node.seq, node.start = other, end - node.length
                return
        raise AssertionError("suffix tree: a surviving node has no other occurrence")

    def _rebest(self, node: _Node) -> None:
        best = None
        for token, child in (node.children or {}).items():
            if best is None or child.count > best.count or (
                    child.count == best.count and token < best_token):
                best, best_token = child, token
        node.best = best
        if not node.children:
            node.children = None

    def _maybe_join(self, node: _Node) -> None:
        """A node whose one child has its count (no suffix ends at it) becomes part of the
        child, as appending would have built it."""
        if (node is self.root or node.parent is None or not node.children
                or len(node.children) != 1):
            return
        (child,) = node.children.values()
        if child.count != node.count:
            return
        parent, key = node.parent, self._first(node)
        child.parent = parent
        child.start -= node.length
        child.length += node.length
        parent.children[key] = child
        if parent.best is node:
            parent.best = child
        node.parent = None  # gone: a later join in this pass skips it

    # ---- speculating ----------------------------------------------------------------

    def match(self, pattern) -> tuple[_Node, int] | None:
        """Where `pattern` (a path from the root) ends: (node, tokens of it used), or None."""
        node, used = self.root, 0
        data = None
        for token in pattern:
            if used == node.length:
                node = node.children.get(token) if node.children else None
                if node is None:
                    return None
                data, used = self.seqs[node.seq], 0
            if data[node.start + used] != token:
                return None
            used += 1
        return node, used

    @staticmethod
    def continues(node: _Node, used: int) -> bool:
        """Does any occurrence of the matched path go on (within max_depth)?"""
        return used < node.length or node.best is not None

    def follow(self, node: _Node, used: int, max_tokens: int, min_prob: float):
        """From a matched path: the most frequent continuation while its estimated
        probability stays >= min_prob, at most max_tokens; (tokens, sum of their
        probabilities)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        data = self.seqs[node.seq]
        while len(tokens) < max_tokens and prob >= min_prob:
            if used < node.length:
                tokens.append(data[node.start + used])
                score += prob
                used += 1
                continue
            child = node.best
            if child is None:
                break
            prob *= child.count / node.count
            node, used, data = child, 0, self.seqs[child.seq]
        return tokens, score
