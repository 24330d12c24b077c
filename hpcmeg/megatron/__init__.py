"""Megatron-LM's file formats and rules as pure, torch-free code (names, layout, args, lr_schedule,
parallel_dims): see each module. The bottom layer: the recipe's validation and every upper package
may import it."""
