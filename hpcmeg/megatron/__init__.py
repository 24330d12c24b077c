"""The Megatron-LM file formats as pure, torch-free rules (names, layout, args): see each module."""
