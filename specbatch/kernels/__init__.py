"""specbatch's own CPU kernels: matrix multiplies, attention over the paged cache, and the
elementwise ops of a decoder layer (``cpu.py`` calls them; ``build.py`` compiles them)."""
