"""The names a model configuration takes, without importing torch (the CLI's parser reads them)."""

BUILTIN_MODEL = "smollm2-135m-instruct"
KERNELS = ("auto", "stock", "packed", "compressed")
FORWARDS = ("auto", "native", "transformers")
BATCH_STEPS = ("auto", "eager", "static", "graphs")
ARITHMETICS = ("exact", "int8")  # the compressed kernels' arithmetic: csrc/qlinear.c, csrc/qlinear_i8.c
# what a configuration names: auto = int8 wherever the compressed kernels run, else exact (docs/kernels.md)
ARITHMETIC_CHOICES = ("auto", *ARITHMETICS)
