"""Adapters that teach other libraries oslo's models: :mod:`oslo.integrations.peft` (PEFT's LoRA, (IA)^3 and
AdaLoRA on oslo's split layers)."""
