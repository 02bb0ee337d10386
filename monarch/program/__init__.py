"""The instruction set the compiler and the workers share: instructions, per-rank programs and their
encoding, and what each collective computes. Imports torch, the standard library and monarch.tensor only.
"""
