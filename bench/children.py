"""Child-run figures per backend (issue 17): fan out and join 1,000 children vs 1,000 triggers.

The measuring code is :mod:`moorline.benchmarks.children`; see it for what each figure means
and which path it measures.

    .venv/bin/python bench/children.py [--rounds 3] [--backends sqlite,postgresql,mysql]
        [--children 1000] [--resumes 10]
"""

from moorline.benchmarks.children import main

if __name__ == "__main__":
    main()
