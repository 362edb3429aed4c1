import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")

# The suite's time budget: each slow test's allowance and the total, printed after every run.
pytest_plugins = ["tests.time_budget"]
