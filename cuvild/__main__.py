from cuvild.serve.daemon import entry

# The guard matters: device workers are spawned processes that re-import the main module.
if __name__ == "__main__":
    entry()  # main(), then out without torch's teardown (cuvild/workers/quick_exit.py)
