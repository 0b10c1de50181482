"""Label texts with an OpenAI-compatible endpoint or an offline encoder (``encoderkit label``), audit a sample
by hand (``encoderkit audit suspect|sample|review|report``), and decide whether a fine-tuned encoder should
replace the labeller.
"""
