"""gradscale: does the scale of my gradients matter? The training side here (`gradscale-run`, from a clone
`python -m experiments.run`), the reading side in gradscale.analysis, the audit in gradscale.audit."""
