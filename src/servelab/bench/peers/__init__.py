"""`servelab bench peers`: servelab beside llama.cpp's server and HF transformers, with this machine's roofline."""
