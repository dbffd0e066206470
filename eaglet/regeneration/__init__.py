"""`eaglet regenerate`'s machinery (eaglet/stages/regenerate.py holds the command's entry point,
`run_regenerate`; eaglet/engines/hf/generate.py the transformers engines).

rounds.py: the records read as prepare reads them and the rounds that replace their assistant
turns; server.py: engine openai (its settings, the check that the server runs the target, the
text a reply stores); output.py: the output's files, what is done already, and the resume check.
"""
