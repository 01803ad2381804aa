"""Exact compressed linear layers for CPU: weights that came from a 4/8-bit block quantisation.

A float32 checkpoint dequantised from GGUF Q4_1 / Q8_0 (the builtin SmolLM2 is one) holds weights
that are exactly `q * d + m` per block of 32 (q 4-bit, d and m float16) or `q * d` (q int8). Reading
those as float32 moves 4 bytes per weight through memory on every forward; on a 2-core CPU that is
most of a narrow forward. `recover_q4` / `recover_q8` find (q, d, m) and check that rebuilding them
gives the stored float32 weight *bit for bit*; `quantize_linears` then swaps each such `nn.Linear`
for a `QLinear` whose C kernel (csrc/qlinear.c) rebuilds the same weights in registers from 0.625
(Q4) / 1.06 (Q8) bytes per weight (codes plus float16 scales). Same weights, so the same model; like
any kernel change, sums are taken in a different order than stock (logits differ by ~1e-5). Tree
and plain decoding both use these kernels, and each output element is computed identically whatever
the number of rows. Layers whose weights do not recover exactly keep their previous kernel.

The kernel comes in three variants, one library each, picked from /proc/cpuinfo at first use
(`kernel_isa`): AVX-512, AVX2 (+FMA, F16C) and portable scalar C. All three compute every output
element with the same written-out sequence of float32 operations, so they give the same bits.

One file per job:
  build.py    CPU feature probe, the gcc build of csrc/*.c into one library per variant, its on-disk
              cache, and loading it (ctypes)
  recover.py  exact recovery of block-quantised weights (pure tensor functions)
  pack.py     the kernels' panel layout (pure tensor functions)
  qlinear.py  the `QLinear` module and `quantize_linears`
Nothing is imported here: `import trserve.engine.model.kernels` stays light.
"""
