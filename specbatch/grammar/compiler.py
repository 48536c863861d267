"""The engine's grammars: each distinct structured output parsed once (when its request is
checked, so a bad one is refused before it is queued) and compiled once, on a thread of its own,
off the step loop; a request waits in the scheduler until its grammar is compiled."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from specbatch.grammar.backend import CompiledGrammarRef, parse, tokenizer_info, xgrammar
from specbatch.structured_outputs import StructuredOutputsParams

CACHE_SIZE = 512  # distinct grammars kept, parsed and compiled (least recently used dropped)


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._vocab, self._stops = tokenizer, vocab_size, stop_token_ids
        self._lock = threading.Lock()
        self._info: Any = None
        self._compiler: Any = None
        self._parsed: OrderedDict[str, Any] = OrderedDict()
        self._compiled: OrderedDict[str, Future[CompiledGrammarRef]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def info(self) -> Any:
        """The tokenizer info (built on first use: it reads the whole vocabulary)."""
        with self._lock:
            if self._info is None:
                self._info = tokenizer_info(self._tokenizer, self._vocab, self._stops)
            return self._info

    def check(self, spec: StructuredOutputsParams) -> Any:
        """``spec``'s parsed grammar; raises ``InvalidInputError`` naming the field. Safe on
        any thread."""
        with self._lock:
            grammar = self._parsed.get(spec.key)
            if grammar is not None:
                self._parsed.move_to_end(spec.key)
                return grammar
        grammar = parse(spec, self.info())
        with self._lock:
            self._parsed[spec.key] = grammar
            while len(self._parsed) > CACHE_SIZE:
                self._parsed.popitem(last=False)
        return grammar

    def compile(self, spec: StructuredOutputsParams) -> Future[CompiledGrammarRef]:
        """The compiled grammar of ``spec`` (checked before), now or once compiled."""
        grammar = self.check(spec)
        with self._lock:
            future = self._compiled.get(spec.key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._compiled.move_to_end(spec.key)
                return future
            if self._compiler is None:
                threads = max(1, min(8, os.cpu_count() or 1))
                self._compiler = xgrammar().GrammarCompiler(
                    self._info, max_threads=threads, cache_enabled=False
                )
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="specbatch-grammar")
            assert self._pool is not None
            compiler, key = self._compiler, spec.key
            future = self._pool.submit(
                lambda: CompiledGrammarRef(key, compiler.compile_grammar(grammar))
            )
            self._compiled[key] = future
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
