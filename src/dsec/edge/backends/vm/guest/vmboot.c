/*
 * vmboot: /init of the full VM's initramfs (built with `gcc -static`, no dependencies).
 *
 * Loads the kernel modules listed in /modules (one path per line, dependencies first;
 * they are the image's own Debian modules), waits for the root disk, mounts it and
 * executes its /sbin/init (systemd). Debian's initramfs does the same through udev
 * coldplug, which costs many seconds under TCG; this takes milliseconds.
 *
 * Kernel arguments it reads: root= (default /dev/vda), rootfstype= (default ext4), ro.
 * Any failure ends PID 1, so the kernel panics and the host sees it on the console.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ROOT_WAIT_MS 20000

static void die(const char *what) {
    dprintf(2, "vmboot: %s: %s\n", what, strerror(errno));
    _exit(1);
}

static void load_modules(void) {
    static char list[16384];
    int fd = open("/modules", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("/modules");
    ssize_t n = read(fd, list, sizeof list - 1);
    close(fd);
    if (n < 0)
        die("read /modules");
    list[n] = 0;
    for (char *line = strtok(list, "\n"); line; line = strtok(NULL, "\n")) {
        int mfd = open(line, O_RDONLY | O_CLOEXEC);
        if (mfd < 0)
            die(line);
        if (syscall(SYS_finit_module, mfd, "", 0) != 0 && errno != EEXIST)
            die(line);
        close(mfd);
        unlink(line); /* the initramfs stays in RAM: free what is done */
    }
}

static void arg(const char *cmdline, const char *key, char *out, size_t size) {
    size_t klen = strlen(key);
    for (const char *p = cmdline; (p = strstr(p, key)); p += klen) {
        if (p != cmdline && p[-1] != ' ')
            continue;
        p += klen;
        size_t i = 0;
        while (p[i] && p[i] != ' ' && p[i] != '\n' && i + 1 < size) {
            out[i] = p[i];
            i++;
        }
        out[i] = 0;
        return;
    }
}

int main(int argc, char **argv) {
    (void)argc;
    mkdir("/dev", 0755);
    mkdir("/proc", 0755);
    mkdir("/root", 0755);
    if (mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") != 0)
        die("mount /dev");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "") != 0)
        die("mount /proc");
    char cmdline[4096] = "";
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
        cmdline[n > 0 ? n : 0] = 0;
        close(fd);
    }
    char root[256] = "/dev/vda", fstype[64] = "ext4";
    arg(cmdline, "root=", root, sizeof root);
    arg(cmdline, "rootfstype=", fstype, sizeof fstype);
    unsigned long flags = strstr(cmdline, " ro ") || !strncmp(cmdline, "ro ", 3) ? MS_RDONLY : 0;

    load_modules();
    struct timespec tick = {0, 5 * 1000 * 1000};
    for (int waited = 0; access(root, F_OK) != 0; waited += 5) {
        if (waited >= ROOT_WAIT_MS) {
            errno = ENODEV;
            die(root);
        }
        nanosleep(&tick, NULL);
    }
    if (mount(root, "/root", fstype, flags, "") != 0)
        die("mount the root disk");
    umount2("/proc", MNT_DETACH);
    if (mount("/dev", "/root/dev", NULL, MS_MOVE, NULL) != 0)
        umount2("/dev", MNT_DETACH);
    unlink("/modules");
    if (chdir("/root") != 0 || mount(".", "/", NULL, MS_MOVE, NULL) != 0 || chroot(".") != 0 ||
        chdir("/") != 0)
        die("switch to the root disk");
    argv[0] = "/sbin/init";
    execv("/sbin/init", argv);
    die("exec /sbin/init");
    return 1;
}
