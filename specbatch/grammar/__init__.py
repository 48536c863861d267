"""Structured outputs: grammars parsed, compiled and cached (engine side) through xgrammar."""
