"""Markdown cards and console text from the analyses: what TensorBoard and the console show."""
