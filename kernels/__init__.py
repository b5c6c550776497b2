"""Kernel modules, one package per backend (``triton``, ``flydsl``); each module registers into its operator."""
