"""The eval stage's machinery (eaglet/stages/evaluate.py holds the stage's entry point, `run_eval`).

inputs.py: the prompt set (held-out samples or eval.prompts), the tokenizer's rendering, and the
draft and target an evaluation loads; decoding.py and replaying.py: one evaluation's
measurement, decoding prompts speculatively and plainly or by replay; progress.py: its bar;
inprocess.py: the loops over prompts and the untrained reference; results.py: result names,
summary lines and the comparison with the untrained draft; context_length.py: tau by the
prompts' context length; plot.py: eval.png.
"""
