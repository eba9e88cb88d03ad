"""Native CPU kernels (C++), compiled once on first use and cached by torch's extension loader
(``native.load_kernel``).

These exist because the CPU is a first-class target (CI, laptops, the default quickstart): the
plain-torch decode attention must gather each sequence's paged KV into a padded copy before its
matmuls, which on a 2-core machine costs as much as the attention itself, and the decoder's
elementwise layers run as four to six torch ops each, with their temporaries, where one pass
over the rows does.
"""
