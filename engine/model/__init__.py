"""The target model on its device: loading and fingerprint (loader.py), the verification forward
(forward.py), the KV cache (kv.py), grouped tree attention (attention.py), exact compressed
kernels (kernels/, csrc/) and oneDNN packed ones (packed.py), cache paths (paths.py).
The transformers modeling code is never edited: modules and the attention function are swapped."""
