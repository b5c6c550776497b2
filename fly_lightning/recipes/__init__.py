"""MoE fine-tuning recipes: ``moe_finetune`` (the ``fly-finetune`` entry point, LightningCLI with an embedded default
model and data) and ``data`` (the synthetic Markov-chain language data it trains on)."""
