"""What training and validation share to look at a model: the renderer (validation prompts through a family's
pipeline), the validation-prompt embedding cache, and the plots (loss curve, sample grids).

Below the stage packages and above the families: the train stage renders in-training samples with it and the
validate stage renders its artifact with it, so neither stage imports the other (tests/unit/test_import_graph.py).
"""
