"""Hands pages of a paged cache out to sequences: :class:`BlockAllocator` (host bookkeeping).

Each sequence owns a list of blocks in position order; full blocks may be shared between
sequences (a fork), with reference counts. The tensors are :mod:`kvcache.paged`'s; nothing here
touches them but :meth:`BlockAllocator.fork`'s copy of a partial last block. Also importable from
:mod:`kvcache.paged` and :mod:`kvcache`.
"""

from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .common import as_int
from .paged import _MAX_SLOTS, PagedKVCache, _pool, _positive

__all__ = ["BlockAllocator", "UnknownSequenceError"]


class UnknownSequenceError(KeyError, ValueError):
    """A :class:`BlockAllocator` was given a sequence id it does not hold (never appended to or
    forked, or freed). A ``ValueError`` (bad input, as the C++ allocator raises) and a ``KeyError``
    (a lookup by key)."""


class BlockAllocator:
    """Hands out pages to sequences: each sequence owns a list of blocks; full blocks may be shared.

    The allocator is host bookkeeping only (no tensors are touched except by :meth:`fork`'s copy
    of a partial last block, through the caches given). Reference counts let a forked sequence
    (beam search, parallel sampling, a shared prompt) share its parent's full blocks: a block
    returns to the free list when its last owner frees it.

    Args:
        num_blocks: Pages in the pool.
        block_size: Slots per page.

    Raises:
        ValueError: A size below 1, or more than ``2**31 - 1`` slots.
        TypeError: A size that is not an int.
    """

    def __init__(self, num_blocks: int, block_size: int):
        num_blocks, block_size = _pool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.tables: Dict[object, List[int]] = {}
        self.lengths: Dict[object, int] = {}

    @property
    def free_blocks(self) -> int:
        """Pages not owned by any sequence."""
        return len(self._free)

    def _table(self, seq_id) -> List[int]:
        table = self.tables.get(seq_id)
        if table is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}")
        return table

    def _release(self, blocks: List[int]) -> None:
        # One reference less to each block; a block no sequence holds returns to the free list.
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError(f"out of pages: all {self.num_blocks} blocks are in use")
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def append(self, seq_id, n: int) -> torch.Tensor:
        """Makes room for ``n`` more tokens of ``seq_id`` (a new id starts empty).

        Args:
            seq_id: Any hashable id of the sequence.
            n: Tokens to add (>= 0).

        Returns:
            ``(n,)`` int64 slot mapping of the new tokens (on the CPU), for :func:`write_pages`.

        Raises:
            ValueError: ``n < 0``; a length past ``2**31 - 1`` tokens; appending to a block shared
                with another sequence (fork copies a shared partial block, so this does not happen
                through the API).
            TypeError: ``n`` not an int.
            RuntimeError: Out of pages.

        On any error (``MemoryError`` included) the allocator is unchanged (a new ``seq_id`` is
        not registered).
        """
        n = as_int("n", n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        table = self.tables.get(seq_id, [])
        length = self.lengths.get(seq_id, 0)
        if length + n > _MAX_SLOTS:
            raise ValueError(f"n must keep {seq_id!r} within 2**31 - 1 tokens, got {length} + {n}")
        need = -(-(length + n) // self.block_size) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"out of pages: {seq_id!r} needs {need} more blocks, {len(self._free)} are free")
        if n and length % self.block_size and self._refs[table[-1]] > 1:
            raise ValueError(f"the last block of {seq_id!r} is shared; fork() gives a copy")
        # The slots come first, over the blocks _take() will hand out (the free list's last
        # `need`, last first): nothing changes before every allocation has succeeded.
        taken = self._free[len(self._free) - need:][::-1]
        blocks = torch.tensor(table[length // self.block_size:] + taken, dtype=torch.int64)
        pos = torch.arange(length, length + n, dtype=torch.int64)
        slots = blocks[pos // self.block_size - length // self.block_size] * self.block_size + pos % self.block_size
        grown = table + taken
        for _ in taken:
            self._take()  # pops `taken`, in order
        self.tables[seq_id] = grown
        self.lengths[seq_id] = length + n
        return slots

    def rollback(self, seq_id, n: int) -> None:
        """Drops the last ``n`` tokens of ``seq_id`` (rejected speculative tokens, a truncation):
        its blocks past the new length return to the pool when no other sequence shares them.

        The slots of the dropped tokens in a kept block are overwritten by the next append's write;
        nothing is read from them meanwhile (the context lengths end before them).

        Args:
            seq_id: A sequence of this allocator.
            n: Tokens to drop, ``0 <= n <= length``.

        Raises:
            UnknownSequenceError: An unknown ``seq_id`` (a ``ValueError`` and a ``KeyError``).
            ValueError: ``n < 0`` or more than the sequence holds; a new last block that is
                partly filled and shared with another sequence (through :meth:`fork`): the next
                append would write into the other sequence's tokens.
            TypeError: ``n`` not an int.

        On any error the allocator is unchanged.
        """
        table = self._table(seq_id)
        n = as_int("n", n)
        length = self.lengths[seq_id]
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > length:
            raise ValueError(f"cannot roll back more tokens than {seq_id!r} holds: n={n}, length={length}")
        new_length = length - n
        keep = -(-new_length // self.block_size)
        if n and new_length % self.block_size and self._refs[table[keep - 1]] > 1:
            raise ValueError(f"rolling {seq_id!r} back to {new_length} tokens would leave its last block, partly "
                             f"filled, shared with another sequence (forked at a later token): roll back to a "
                             f"multiple of block_size={self.block_size}, or no further than the length it was "
                             f"forked at")
        self._release(table[keep:])
        del table[keep:]
        self.lengths[seq_id] = new_length

    def free(self, seq_id) -> None:
        """Releases ``seq_id``'s blocks (shared ones when their last owner frees them).

        Args:
            seq_id: A sequence of this allocator.

        Raises:
            UnknownSequenceError: An unknown ``seq_id`` (a ``ValueError`` and a ``KeyError``).
        """
        self._release(self._table(seq_id))
        del self.tables[seq_id], self.lengths[seq_id]

    def fork(self, parent, child, caches: Iterable[PagedKVCache] = ()) -> None:
        """``child`` continues from ``parent``'s tokens: full blocks shared, a partial last block
        copied into a new page of every cache in ``caches`` (so the two can diverge).

        Args:
            parent: A sequence of this allocator.
            child: A new sequence id.
            caches: Every layer's :class:`PagedKVCache` over this allocator's pages. The partial
                last block is copied in these only: a layer left out is not copied, and the
                child then reads an unwritten page there (no error can tell).

        Raises:
            UnknownSequenceError: An unknown ``parent`` (a ``ValueError`` and a ``KeyError``).
            ValueError: ``child`` already exists; a cache whose pages are not this allocator's
                geometry (``num_blocks``, ``block_size``).
            TypeError: ``caches`` not an iterable of :class:`PagedKVCache`.
            RuntimeError: Out of pages.

        On any error the allocator is unchanged and no page a sequence owns is written.
        """
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already exists")
        table = self._table(parent)
        length = self.lengths[parent]
        try:
            caches = list(caches)
        except TypeError:
            raise TypeError(f"caches must be an iterable of PagedKVCache, got {type(caches).__name__}") from None
        for c in caches:
            if not isinstance(c, PagedKVCache):
                raise TypeError(f"caches must hold PagedKVCache objects, got {type(c).__name__}")
            if c.num_blocks != self.num_blocks or c.block_size != self.block_size:
                raise ValueError(f"caches must have num_blocks={self.num_blocks} pages of block_size="
                                 f"{self.block_size}, got {c.num_blocks} of {c.block_size}")
        none = torch.empty(0, dtype=torch.int64)
        for c in caches:
            # Every cache's checks (writable pages and scales) run whether or not a block is
            # copied, as the C++ fork's do.
            c.copy_blocks(none.to(c.key_pages.device), none.to(c.key_pages.device))
        shared = table if length % self.block_size == 0 else table[:-1]
        new = list(shared)
        if len(shared) < len(table):
            if not self._free:
                raise RuntimeError("out of pages: fork needs one block for the partial last block")
            copy = self._free[-1]  # taken only once every copy succeeded
            src, dst = torch.tensor([table[-1]]), torch.tensor([copy])
            for c in caches:
                c.copy_blocks(src.to(c.key_pages.device), dst.to(c.key_pages.device))
            new.append(self._take())
        for b in shared:
            self._refs[b] += 1
        self.tables[child] = new
        self.lengths[child] = length

    def block_table(self, seq_ids: Sequence, max_blocks: Optional[int] = None,
                    device=None) -> torch.Tensor:
        """The block table of ``seq_ids``, for :func:`attend_pages`.

        Args:
            seq_ids: Sequences of this allocator, in the order of the attend's sequences.
            max_blocks: The table's width (a fixed width keeps a compiled step's shapes); default:
                the longest table.
            device: Where the table goes (default: CPU).

        Returns:
            ``(len(seq_ids), max_blocks)`` int32: row ``i`` lists sequence ``i``'s pages in
            position order, padded with -1.

        Raises:
            UnknownSequenceError: An unknown sequence (a ``ValueError`` and a ``KeyError``).
            ValueError: ``max_blocks`` below 1 or below a sequence's block count.
            TypeError: ``max_blocks`` not an int.
        """
        seq_ids = list(seq_ids)
        tables = [self._table(s) for s in seq_ids]
        width = max([len(t) for t in tables] + [1]) if max_blocks is None else _positive("max_blocks", max_blocks)
        out = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            if len(t) > width:
                raise ValueError(f"sequence {seq_ids[i]!r} has {len(t)} blocks, more than max_blocks={width}")
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device) if device is not None else out

    def context_lens(self, seq_ids: Sequence, device=None) -> torch.Tensor:
        """The tokens each sequence holds, for :func:`attend_pages`.

        Args:
            seq_ids: Sequences of this allocator.
            device: Where the lengths go (default: CPU).

        Returns:
            ``(len(seq_ids),)`` int32.

        Raises:
            UnknownSequenceError: An unknown sequence (a ``ValueError`` and a ``KeyError``).
        """
        seq_ids = list(seq_ids)
        for s in seq_ids:
            self._table(s)
        return torch.tensor([self.lengths[s] for s in seq_ids], dtype=torch.int32, device=device)
