/*
 * init: PID 1 of every OpenDsec container (built with `gcc -static -O2`, no dependencies).
 *
 * - starts aether, the runtime agent, through the bundle's own dynamic loader and Python,
 *   passing it the listening socket (fd DSEC_LISTEN_FD, default 3) created by the edge;
 * - restarts aether whenever it exits, after 50 ms doubling up to 2 s (reset once it has
 *   run for 10 s);
 * - reaps every zombie (orphans are reparented to PID 1);
 * - on SIGTERM or SIGINT sends SIGTERM to every process, waits up to 2 s, sends SIGKILL
 *   and exits 0. When not PID 1 (tests) it only signals aether, never kill(-1).
 *
 * The bundle directory is the directory of argv[0] (`/.dsec/init` -> `/.dsec`).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 2000
#define HEALTHY_MS 10000
#define STOP_GRACE_MS 2000

static const char AETHER_MAIN[] = "from dsec.agent.aether import main; main()";

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void say(const char *msg) {
    dprintf(2, "init: %s\n", msg);
}

static pid_t start_aether(const char bundle[PATH_MAX - 64], const sigset_t *old_mask) {
    static char loader[PATH_MAX], libdir[PATH_MAX], python[PATH_MAX];
    snprintf(loader, sizeof loader, "%s/lib/ld.so", bundle);
    snprintf(libdir, sizeof libdir, "%s/lib", bundle);
    snprintf(python, sizeof python, "%s/python/bin/python3", bundle);
    pid_t pid = fork();
    if (pid != 0) {
        if (pid < 0)
            say("fork failed");
        return pid > 0 ? pid : 0;
    }
    sigprocmask(SIG_SETMASK, old_mask, NULL);
    char *argv[] = {loader, "--library-path", libdir, python, "-s", "-S", "-P", "-c",
                    (char *)AETHER_MAIN, NULL};
    execv(loader, argv);
    dprintf(2, "init: cannot exec %s: %s\n", loader, strerror(errno));
    _exit(127);
}

/* Reap every exited child; return 1 if aether was among them. */
static int reap(pid_t aether) {
    int status, aether_died = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        if (pid == aether)
            aether_died = 1;
    return aether_died;
}

static void stop_all(pid_t aether, int is_pid1) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (is_pid1)
        kill(-1, SIGTERM);
    else if (aether > 0)
        kill(aether, SIGTERM);
    long long deadline = now_ms() + STOP_GRACE_MS;
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        if (is_pid1 ? (waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD)
                    : (aether <= 0 || kill(aether, 0) < 0))
            return;
        long long left = deadline - now_ms();
        if (left <= 0)
            break;
        struct timespec ts = {left / 1000, (left % 1000) * 1000000};
        sigtimedwait(&chld, NULL, &ts);
    }
    if (is_pid1) {
        kill(-1, SIGKILL);
        while (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
            ;
    } else if (aether > 0) {
        kill(aether, SIGKILL);
        waitpid(aether, NULL, 0);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    static char bundle[PATH_MAX - 64] = "/.dsec";
    const char *slash = strrchr(argv[0], '/');
    if (slash && slash != argv[0] && (size_t)(slash - argv[0]) < sizeof bundle)
        snprintf(bundle, sizeof bundle, "%.*s", (int)(slash - argv[0]), argv[0]);

    const char *fd_env = getenv("DSEC_LISTEN_FD");
    int listen_fd = fd_env ? atoi(fd_env) : 3;
    if (fcntl(listen_fd, F_GETFD) < 0) {
        dprintf(2, "init: no listening socket on fd %d\n", listen_fd);
        return 1;
    }
    fcntl(listen_fd, F_SETFD, 0); /* inherited by every aether */
    char fd_str[16], home[PATH_MAX], path[PATH_MAX];
    snprintf(fd_str, sizeof fd_str, "%d", listen_fd);
    snprintf(home, sizeof home, "%s/python", bundle);
    snprintf(path, sizeof path, "%s/site", bundle);
    setenv("DSEC_LISTEN_FD", fd_str, 1);
    setenv("PYTHONHOME", home, 1);
    setenv("PYTHONPATH", path, 1);
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
    if (!getenv("PATH"))
        setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);

    sigset_t set, old_mask;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, &old_mask);

    int is_pid1 = getpid() == 1;
    long long backoff = BACKOFF_MIN_MS, started_at = 0, restart_at = 0;
    pid_t aether = 0;
    for (;;) {
        long long now = now_ms();
        if (aether == 0 && now >= restart_at) {
            aether = start_aether(bundle, &old_mask);
            started_at = now;
            if (aether == 0)
                restart_at = now + BACKOFF_MAX_MS;
        }
        long long wait = aether == 0 ? restart_at - now : 60000;
        if (wait < 1)
            wait = 1;
        struct timespec ts = {wait / 1000, (wait % 1000) * 1000000};
        int sig = sigtimedwait(&set, NULL, &ts);
        if (sig == SIGTERM || sig == SIGINT) {
            stop_all(aether, is_pid1);
            return 0;
        }
        if (reap(aether)) {
            now = now_ms();
            if (now - started_at >= HEALTHY_MS)
                backoff = BACKOFF_MIN_MS;
            say("aether exited; restarting");
            restart_at = now + backoff;
            backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
            aether = 0;
        }
    }
}
