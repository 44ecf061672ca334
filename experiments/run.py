"""`python -m experiments.run -m optimizer=sgd,adamw scale=1,8` from a clone: gradscale's sweep entry under the name
the project started with (installed, it is `gradscale-run`). Nothing else lives here."""

from gradscale.run import cli

if __name__ == "__main__":
    cli()
