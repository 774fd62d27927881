"""Exit codes of the ``ssdrbm`` command, one per kind of outcome a script may want to branch on."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What ``ssdrbm`` returns to the shell.

    ========================  ====  ==========================================================
    OK                        0     the command did what was asked (a watched job SUCCEEDED or
                                    was STOPPED by its sweep's early stopping)
    ERROR                     1     anything else that went wrong (server error, bad file, ...)
    USAGE                     2     bad command line or an argument the service refused
    UNAVAILABLE               3     the service could not be reached, or did not answer in time
    NOT_FOUND                 4     unknown job, dataset or checkpoint
    UNAUTHENTICATED           5     missing or refused token, or not allowed
    JOB_FAILED                6     the watched job ended FAILED
    JOB_CANCELLED             7     the watched job ended CANCELLED
    NOT_READY                 8     the job cannot answer yet (e.g. no checkpoint so far)
    LIMIT                     9     a service limit was hit (message size, jobs per tenant, ...)
    INTERRUPTED               130   stopped with Ctrl-C (128 + SIGINT, as shells expect)
    BROKEN_PIPE               141   the reader of the output went away (``| head``): 128 +
                                    SIGPIPE, as coreutils report it, without a message
    ========================  ====  ==========================================================
    """

    OK = 0
    ERROR = 1
    USAGE = 2
    UNAVAILABLE = 3
    NOT_FOUND = 4
    UNAUTHENTICATED = 5
    JOB_FAILED = 6
    JOB_CANCELLED = 7
    NOT_READY = 8
    LIMIT = 9
    INTERRUPTED = 130
    BROKEN_PIPE = 141
