"""The names a model configuration takes, without importing torch (the CLI's parser reads them)."""

BUILTIN_MODEL = "smollm2-135m-instruct"
KERNELS = ("auto", "stock", "packed", "compressed")
FORWARDS = ("auto", "native", "transformers")
BATCH_STEPS = ("auto", "eager", "static", "graphs")
ARITHMETICS = ("exact", "int8")  # the compressed kernels' arithmetic: csrc/qlinear.c, csrc/qlinear_i8.c
# what a configuration names: auto = int8 wherever the compressed kernels run, else exact (docs/kernels.md)
ARITHMETIC_CHOICES = ("auto", *ARITHMETICS)
# `--quantize`: what a transformers checkpoint's float linears become at load (engine/model/checkpoint.py);
# auto = QUANTIZE_DEFAULT, the cheapest format that met int8's fidelity rule on the bundled model's own
# bfloat16 checkpoint, in the exact arithmetic (docs/kernels.md); none = float weights (the GPU path)
QUANTIZE = ("q8_0", "q6_k", "q4_k", "none")
QUANTIZE_CHOICES = ("auto", *QUANTIZE)
QUANTIZE_DEFAULT = "q8_0"
