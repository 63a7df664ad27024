"""A disk that fills up and frees again, for one real worker process, without mounts.

An LD_PRELOAD shim (compiled here with the system C compiler) makes every
write, fsync and allocation of a file under the worker's data directory fail
with ENOSPC while a flag file exists, as a full disk does; files elsewhere
(its log) and sockets are untouched. `DiskFault.fill()` creates the flag,
`free()` removes it: the process sees the disk come back without restarting.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static const char *flag, *root;
static size_t root_len;

__attribute__((constructor)) static void init(void) {
    flag = getenv("SHARDGRID_DISKFULL_FLAG");
    root = getenv("SHARDGRID_DISKFULL_ROOT");
    root_len = root ? strlen(root) : 0;
}

/* Under the data directory while the flag exists: refuse, as a full disk does. */
static int full(int fd) {
    char link[64], path[4096];
    ssize_t n;
    if (!flag || !root_len || access(flag, F_OK) != 0)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n < (ssize_t)root_len)
        return 0;
    path[n] = 0;
    if (strncmp(path, root, root_len) != 0 || (path[root_len] != '/' && path[root_len] != 0))
        return 0;
    errno = ENOSPC;
    return 1;
}

#define REAL(name) static __typeof__(name) *real; if (!real) real = dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *buf, size_t count) { REAL(write); return full(fd) ? -1 : real(fd, buf, count); }
ssize_t writev(int fd, const struct iovec *iov, int cnt) { REAL(writev); return full(fd) ? -1 : real(fd, iov, cnt); }
ssize_t pwrite(int fd, const void *buf, size_t count, off_t off) {
    REAL(pwrite); return full(fd) ? -1 : real(fd, buf, count, off);
}
ssize_t pwrite64(int fd, const void *buf, size_t count, off_t off) {
    REAL(pwrite64); return full(fd) ? -1 : real(fd, buf, count, off);
}
int fsync(int fd) { REAL(fsync); return full(fd) ? -1 : real(fd); }
int fdatasync(int fd) { REAL(fdatasync); return full(fd) ? -1 : real(fd); }
int fallocate(int fd, int mode, off_t off, off_t len) { REAL(fallocate); return full(fd) ? -1 : real(fd, mode, off, len); }
int fallocate64(int fd, int mode, off_t off, off_t len) {
    REAL(fallocate64); return full(fd) ? -1 : real(fd, mode, off, len);
}
/* posix_fallocate returns the error instead of setting errno. */
int posix_fallocate(int fd, off_t off, off_t len) { REAL(posix_fallocate); return full(fd) ? ENOSPC : real(fd, off, len); }
int posix_fallocate64(int fd, off_t off, off_t len) {
    REAL(posix_fallocate64); return full(fd) ? ENOSPC : real(fd, off, len);
}
"""


class DiskFault:
    def __init__(self, work: Path, data: Path) -> None:
        """`work`: where the shim and the flag go; `data`: the directory that fills up."""
        self.work = work
        self.data = data.resolve()
        self.flag = work / "disk-full"

    def build(self) -> Path:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("this fault needs a C compiler (Debian package `gcc`; .ci/run installs it)")
        self.work.mkdir(parents=True, exist_ok=True)
        src, lib = self.work / "diskfull.c", self.work / "diskfull.so"
        src.write_text(_SHIM)
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True,
                       capture_output=True, timeout=60)
        return lib

    def env(self) -> dict[str, str]:
        """The environment of the worker process that gets the disk."""
        return {"LD_PRELOAD": str(self.build()), "SHARDGRID_DISKFULL_FLAG": str(self.flag),
                "SHARDGRID_DISKFULL_ROOT": str(self.data)}

    def fill(self) -> None:
        self.flag.touch()

    def free(self) -> None:
        self.flag.unlink(missing_ok=True)
