"""Adapters that teach other libraries oslo's models: :mod:`oslo.integrations.peft` (PEFT's LoRA, (IA)^3 and
AdaLoRA on oslo's split layers) and :mod:`oslo.integrations.trainer` (transformers' ``Trainer`` checkpoints and
resumes of split models)."""
