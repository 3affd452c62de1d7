"""``python -m moorline``: the command line."""

from moorline.cli.main import main

if __name__ == "__main__":
    main()
