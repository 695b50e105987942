/* The function worker's zygote: forks each call's process, off Python.
 *
 * Runs inside a worker's namespaces and root (see worker.py), talking to the worker over
 * fd 3 (SOCK_SEQPACKET).  argv[1] is the number of image layers (/l0 .. /lN-1 in the root).
 *
 * worker -> zygote:  first message: the seccomp BPF program (struct sock_filter[]);
 *                    then one message per call: "G" uid gid ngroups groups[] then
 *                    NUL-terminated path, cwd, argc argv[], env[] (all u32 little endian),
 *                    with stdin/stdout/stderr as SCM_RIGHTS; or "D" (discard the child);
 *                    after each call's "X": "N" (prepare the next call's process; the
 *                    worker sends it once the call's answer is out, so building it
 *                    never competes with the call)
 * zygote -> worker:  "H"           started (the worker pivots only then)
 *                    "R" pid       the next call's process is prepared (its root is built),
 *                                  with its pidfd (after the previous call's "X" and "N")
 *                    "S" stage err the call's process exec'd (stage 0) or failed
 *                                  (1 cwd, 2 exec, 3 other, 4 discarded)
 *                    "X" status    the call's command exited (its wait status; that of
 *                                  the call's process if it died first, e.g. killed)
 *                    "E" text      a process could not be prepared
 *
 * A prepared process is pid 1 of new pid, mount, ipc and cgroup namespaces: it mounts a
 * fresh tmpfs on /call, an overlay of the layers over it, its own /proc and /dev, pivots
 * into it and forks the command's process (pid 2), which starts its own session, sets
 * no_new_privs, loads the seccomp filter and waits (none of it depends on the call, so
 * all of it is done ahead).  Per call, pid 2 takes its pipes, becomes the user and execs
 * the command; pid 1 stays as the call's init: it forwards the signals
 * it gets to the command's process group (a command as pid 1 would ignore SIGTERM without
 * a handler), reaps orphans, and when the command exits it kills and reaps all the call
 * started, writes the command's wait status to its status pipe and exits.  The zygote
 * reports the exit ("X") as soon as that status is written: the teardown of the call's
 * namespaces and mounts (at the init's exit) is off the call's path.  The init is off the
 * start's path too: it closes the link at once, so the zygote still sees the exec (or the
 * command's failure) on the link itself.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#define WORKER 3
#define MAX_MSG (4 << 20)
#define CALL_NS (CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWCGROUP)

static struct sock_fprog filter;
static int layers;
static char *msg;

static void say(const char *kind, const void *data, size_t n) {
    char buf[512];
    if (n > sizeof buf - 1) n = sizeof buf - 1;
    buf[0] = kind[0];
    memcpy(buf + 1, data, n);
    send(WORKER, buf, n + 1, MSG_NOSIGNAL);
}

static void say2(const char *kind, int32_t a, int32_t b) {
    int32_t v[2] = {a, b};
    say(kind, v, sizeof v);
}

static int fail(const char *what) {
    char text[256];
    int n = snprintf(text, sizeof text, "%s: %s", what, strerror(errno));
    say("E", text, (size_t)n);
    return -1;
}

/* In the new process: build the call's root (a fresh tmpfs, an overlay over it, /proc, /dev). */
static int build_root(void) {
    static const struct { const char *name; int major, minor; } devs[] = {
        {"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}};
    static const char *links[][2] = {{"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"},
                                     {"stdout", "/proc/self/fd/1"}, {"stderr", "/proc/self/fd/2"}};
    char opts[8192], path[64];
    size_t o = 0;
    if (mount("tmpfs", "/call", "tmpfs", MS_NOSUID | MS_NODEV, "size=1024m,mode=0755"))
        return -1;
    if (mkdir("/call/upper", 0755) || mkdir("/call/work", 0755) || mkdir("/call/root", 0755))
        return -1;
    o += (size_t)snprintf(opts, sizeof opts, "lowerdir=");
    for (int i = 0; i < layers; i++)
        o += (size_t)snprintf(opts + o, sizeof opts - o, "%s/l%d", i ? ":" : "", i);
    snprintf(opts + o, sizeof opts - o, ",upperdir=/call/upper,workdir=/call/work");
    if (mount("overlay", "/call/root", "overlay", MS_NODEV, opts)) return -1;
    mkdir("/call/root/proc", 0755);
    mkdir("/call/root/dev", 0755);
    mkdir("/call/root/tmp", 01777);
    if (chmod("/call/root/tmp", 01777)) return -1;
    if (mount("proc", "/call/root/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
        return -1;
    if (mount("tmpfs", "/call/root/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755"))
        return -1;
    for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) {
        snprintf(path, sizeof path, "/call/root/dev/%s", devs[i].name);
        if (mknod(path, S_IFCHR | 0666, makedev(devs[i].major, devs[i].minor)) ||
            chmod(path, 0666))
            return -1;
    }
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) {
        snprintf(path, sizeof path, "/call/root/dev/%s", links[i][0]);
        if (symlink(links[i][1], path)) return -1;
    }
    if (mkdir("/call/root/dev/shm", 01777) || chmod("/call/root/dev/shm", 01777)) return -1;
    if (chdir("/call/root") || syscall(SYS_pivot_root, ".", ".") || umount2(".", MNT_DETACH) ||
        chdir("/"))
        return -1;
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);  /* not the worker's */
    if (fd < 0 || write(fd, "0", 1) != 1) return -1;
    close(fd);
    return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
}

static uint32_t u32(const char **p, const char *end) {
    uint32_t v = 0;
    if (*p + 4 <= end) memcpy(&v, *p, 4);
    *p += 4;
    return v;
}

static char *str(const char **p, const char *end) {
    const char *s = *p;
    const char *z = s < end ? memchr(s, 0, (size_t)(end - s)) : NULL;
    if (!z) { *p = end + 1; return NULL; }
    *p = z + 1;
    return (char *)s;
}

/* The call's init (pid 1): forward signals to the command, reap, report its status. */
static void call_init(pid_t cmd, int status_fd) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);  /* taken with sigwaitinfo, never delivered */
    setsid();
    for (int i = 0; i < 3; i++) close(i);  /* the zygote's: the command has its own pipes */
    for (;;) {
        int status;
        pid_t p;
        while ((p = waitpid(-1, &status, WNOHANG)) > 0) {
            if (p == cmd) {  /* end the call now; its namespaces are torn down after */
                kill(-1, SIGKILL);  /* everything else the call started (not the init) */
                while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {
                }
                int32_t w = status;
                if (write(status_fd, &w, sizeof w) < 0) _exit(1);
                _exit(0);
            }
        }
        siginfo_t si;
        int sig = sigwaitinfo(&all, &si);
        if (sig > 0 && sig != SIGCHLD && kill(-cmd, sig) < 0) kill(cmd, sig);
    }
}

/* pid 2, ahead of the call: what does not depend on the call.  -1 on failure. */
static int prepare_command(void) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int s = 1; s < 32; s++) signal(s, SIG_DFL);
    if (setsid() < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter, 0, 0))
        return -1;
    return 0;
}

/* pid 2: wait for the call, then exec its command.  Never returns. */
static void serve(int link) {
    struct msghdr mh = {0};
    struct iovec iov = {msg, MAX_MSG};
    char cbuf[CMSG_SPACE(3 * sizeof(int))];
    int fds[3] = {-1, -1, -1};
    int32_t rep[2] = {3, 0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(link, &mh, MSG_CMSG_CLOEXEC);
    if (n <= 0) _exit(0);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    if (c && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof fds))
        memcpy(fds, CMSG_DATA(c), sizeof fds);
    if (msg[0] != 'G' || fds[2] < 0) { rep[0] = 4; goto out; }
    const char *p = msg + 1, *end = msg + n;
    uid_t uid = u32(&p, end);
    gid_t gid = u32(&p, end);
    uint32_t ng = u32(&p, end);
    gid_t groups[64];
    if (ng > 64) goto out;
    for (uint32_t i = 0; i < ng; i++) groups[i] = u32(&p, end);
    char *path = str(&p, end), *cwd = str(&p, end);
    uint32_t argc = u32(&p, end);
    if (!path || !cwd || argc == 0 || argc > 65536 || p > end) goto out;
    char **argv = calloc(argc + 1, sizeof *argv);
    size_t envc = 0, cap = 64;
    char **envp = calloc(cap + 1, sizeof *envp);
    if (!argv || !envp) goto out;
    for (uint32_t i = 0; i < argc; i++)
        if (!(argv[i] = str(&p, end))) goto out;
    while (p < end) {
        if (envc == cap && !(envp = realloc(envp, ((cap *= 2) + 1) * sizeof *envp))) goto out;
        if (!(envp[envc++] = str(&p, end))) goto out;
        envp[envc] = NULL;
    }
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0) goto out;
    for (int i = 0; i < 3; i++)
        if (fds[i] > 2) close(fds[i]);
    if (setgroups(ng, groups) || setgid(gid) || setuid(uid)) goto out;
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);  /* setuid reset it */
    rep[0] = 1;
    if (chdir(cwd)) goto out;
    rep[0] = 2;
    execve(path, argv, envp);  /* closes the link (cloexec): the zygote sees the exec */
out:
    rep[1] = errno;
    send(link, rep, sizeof rep, MSG_NOSIGNAL);
    _exit(127);
}

/* Fork the next call's process (it builds its root on its own); return its pid, or -1. */
static pid_t spawn_next(int *link, int *status_fd) {
    int sp[2], st[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp)) return fail("socketpair");
    if (pipe2(st, O_CLOEXEC)) {
        close(sp[0]);
        close(sp[1]);
        return fail("pipe");
    }
    pid_t pid = (pid_t)syscall(SYS_clone, CALL_NS | SIGCHLD, NULL, NULL, NULL, NULL);
    if (pid < 0) {
        close(sp[0]);
        close(sp[1]);
        close(st[0]);
        close(st[1]);
        return fail("clone");
    }
    if (pid == 0) {
        close(sp[0]);
        close(st[0]);
        close(WORKER);
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        pid_t cmd = build_root() ? -1 : fork();
        if (cmd == 0) {
            close(st[1]);  /* the init reports the status */
            if (prepare_command() == 0) {
                send(sp[1], "R", 1, MSG_NOSIGNAL);
                serve(sp[1]);
            }
            cmd = -1;
        }
        if (cmd < 0) {
            char text[128];
            int k = snprintf(text, sizeof text, "E%s", strerror(errno));
            send(sp[1], text, (size_t)k, MSG_NOSIGNAL);
            _exit(1);
        }
        close(sp[1]);  /* pid 2 holds the link now */
        call_init(cmd, st[1]);
    }
    close(sp[1]);
    close(st[1]);
    *link = sp[0];
    *status_fd = st[0];
    return pid;
}

/* Wait until the next process has built its root; tell the worker ("R" + pidfd or "E"). */
static pid_t await_ready(pid_t pid, int *link) {
    if (pid < 0) return pid;
    char r[128];
    ssize_t n = recv(*link, r, sizeof r, 0);
    int pfd = n == 1 && r[0] == 'R' ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
    if (pfd < 0) {  /* the pidfd lets the worker see the exit even after we reaped it */
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        close(*link);
        if (n > 1) say("E", r + 1, (size_t)n - 1);
        else say("E", "prepare: the process died", 25);
        return -1;
    }
    char r1[1 + sizeof(int32_t)] = {'R'}, cb[CMSG_SPACE(sizeof(int))];
    int32_t p32 = pid;
    memcpy(r1 + 1, &p32, sizeof p32);
    struct iovec iov = {r1, sizeof r1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb,
                        .msg_controllen = sizeof cb};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pfd, sizeof(int));
    sendmsg(WORKER, &mh, MSG_NOSIGNAL);
    close(pfd);
    return pid;
}

/* Prepare the next call's process and tell the worker: its pid (> 0), or -1 (told "E"). */
static pid_t prepare(int *link, int *status_fd) {
    pid_t pid = await_ready(spawn_next(link, status_fd), link);
    if (pid < 0 && *status_fd >= 0) {
        close(*status_fd);
        *status_fd = -1;
    }
    return pid;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    layers = atoi(argv[1]);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_NAME, "dsec-fn-zygote", 0, 0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    msg = malloc(MAX_MSG);
    say("H", "", 0);  /* exec'd: the worker may pivot now (this binary is static) */
    static char prog[1 << 20];
    ssize_t n = recv(WORKER, prog, sizeof prog, 0);
    if (!msg || n <= 0 || n % sizeof(struct sock_filter)) return 1;
    filter.len = (unsigned short)(n / sizeof(struct sock_filter));
    filter.filter = (struct sock_filter *)prog;
    int link = -1, status_fd = -1;
    pid_t next = prepare(&link, &status_fd);
    for (;;) {
        char cbuf[CMSG_SPACE(3 * sizeof(int))];
        struct iovec iov = {msg, MAX_MSG};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                            .msg_controllen = sizeof cbuf};
        n = recvmsg(WORKER, &mh, MSG_CMSG_CLOEXEC);
        if (n <= 0) break;
        if (n == 1 && msg[0] == 'N') {
            if (next == 0) next = prepare(&link, &status_fd);  /* (one is enough) */
            continue;
        }
        if (next <= 0) break;  /* the worker was told (E), or skipped "N" */
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        int nfd = c && c->cmsg_type == SCM_RIGHTS ? (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int)) : 0;
        int fds[3] = {-1, -1, -1};
        if (nfd == 3) memcpy(fds, CMSG_DATA(c), sizeof fds);
        struct msghdr out = {.msg_iov = &iov, .msg_iovlen = 1};
        iov.iov_len = (size_t)n;
        if (nfd == 3) {
            out.msg_control = cbuf;
            out.msg_controllen = CMSG_SPACE(sizeof fds);
        }
        int32_t rep[2] = {0, 0};
        if (sendmsg(link, &out, MSG_NOSIGNAL) < 0) {
            rep[0] = 3;
            rep[1] = errno;
        }
        for (int i = 0; i < 3; i++)
            if (fds[i] >= 0) close(fds[i]);
        if (rep[0] == 0) {
            ssize_t k = recv(link, rep, sizeof rep, 0);  /* EOF: exec'd (the link is cloexec) */
            if (k != sizeof rep) rep[0] = rep[1] = 0;
            if (msg[0] != 'G') rep[0] = 4;
        }
        close(link);
        link = -1;
        int ran = status_fd;  /* the call's init writes its command's status here */
        status_fd = -1;
        say2("S", rep[0], rep[1]);
        pid_t running = next;
        next = 0;  /* the next one is prepared when the worker says "N" */
        int status = 0;
        int32_t w;
        ssize_t got;
        while ((got = read(ran, &w, sizeof w)) < 0 && errno == EINTR) {
        }
        close(ran);
        if (got == (ssize_t)sizeof w) say2("X", w, 0);  /* nothing of the call runs now */
        while (waitpid(running, &status, 0) < 0 && errno == EINTR) {
        }
        if (got != (ssize_t)sizeof w) say2("X", status, 0);  /* the init died: killed */
    }
    if (next > 0) {
        kill(next, SIGKILL);
        waitpid(next, NULL, 0);
    }
    return 0;
}
