/*
 * vminit: PID 1 of an OpenDsec microVM, the only file in its initramfs (gcc -static).
 *
 * Disks are found by their virtio serial (/sys/block/vdX/serial), or, when the kernel
 * command line has dsec.disks=config,bundle,... (Firecracker, whose disk serials are
 * derived from the host file, not the drive id), by their order: vda, vdb, ...
 *   config    raw: "DSECCFG\0" then "key=value\0" entries, ended by an empty entry.
 *             dsec.* keys are for vminit (dsec.layers = number of image layers), the
 *             rest is the environment of the agent.
 *   bundle    erofs: the agent bundle, mounted read-only at /.dsec
 *   l0..lN-1  erofs: the image layers, bottom first (overlayfs lower dirs)
 *   scratch   ext4: upper/ and work/ of the overlay (the sandbox's writable layer)
 *
 * It mounts the root (overlay), the API filesystems inside it, moves it onto / and
 * chroots, sets the hostname (/etc/hostname, /etc/hosts and /etc/machine-id on a tmpfs,
 * bind-mounted: see ident_file), binds the agent socket (/.dsec/run/aether.sock, passed as
 * fd 3), starts the channel multiplexer (vmport.c, linked in; restarted when it exits) and
 * finally execs the bundle's init, which runs aether and reaps orphans as PID 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_DISKS 64
#define MAX_ENV 512
#define CFG_MAX (256 * 1024)

static char disk_serial[MAX_DISKS][64], disk_dev[MAX_DISKS][272];
static int ndisks;
static char cfg[CFG_MAX];
static char *entries[MAX_ENV + 1], *envp[MAX_ENV + 1];

static void die(const char *what) {
    dprintf(2, "vminit: %s: %s\n", what, strerror(errno));
    sync();
    _exit(1); /* PID 1 exiting panics the kernel: the host sees it on the console */
}

static void must_mount(const char *src, const char *dst, const char *type, unsigned long fl,
                       const char *data) {
    mkdir(dst, 0755);
    if (mount(src, dst, type, fl, data) != 0) {
        dprintf(2, "vminit: mount %s on %s (%s): %s\n", src, dst, type, strerror(errno));
        die("mount");
    }
}

/* dsec.disks=a,b,c on the kernel command line: vda is a, vdb is b, ... (0: not given) */
static int disks_from_cmdline(void) {
    static char buf[4096];
    int fd = open("/proc/cmdline", O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strstr(buf, "dsec.disks=");
    if (!p || (p != buf && p[-1] != ' '))
        return 0;
    p += strlen("dsec.disks=");
    while (*p && *p != ' ' && *p != '\n' && ndisks < 26) {
        size_t len = strcspn(p, ", \n");
        if (len == 0 || len >= sizeof disk_serial[0])
            break;
        memcpy(disk_serial[ndisks], p, len);
        disk_serial[ndisks][len] = 0;
        snprintf(disk_dev[ndisks], sizeof disk_dev[0], "/dev/vd%c", 'a' + ndisks);
        ndisks++;
        p += len;
        if (*p == ',')
            p++;
    }
    return ndisks;
}

static void find_disks(void) {
    if (disks_from_cmdline() > 0)
        return;
    DIR *d = opendir("/sys/block");
    if (!d)
        die("/sys/block");
    struct dirent *e;
    while ((e = readdir(d)) && ndisks < MAX_DISKS) {
        if (strncmp(e->d_name, "vd", 2) != 0)
            continue;
        char p[300];
        snprintf(p, sizeof p, "/sys/block/%s/serial", e->d_name);
        int fd = open(p, O_RDONLY);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, disk_serial[ndisks], sizeof disk_serial[0] - 1);
        close(fd);
        if (n <= 0)
            continue;
        while (n > 0 && (disk_serial[ndisks][n - 1] == '\n' || disk_serial[ndisks][n - 1] == 0))
            n--;
        disk_serial[ndisks][n] = 0;
        snprintf(disk_dev[ndisks], sizeof disk_dev[0], "/dev/%s", e->d_name);
        ndisks++;
    }
    closedir(d);
}

static const char *disk(const char *serial) {
    for (int i = 0; i < ndisks; i++)
        if (strcmp(disk_serial[i], serial) == 0)
            return disk_dev[i];
    dprintf(2, "vminit: no disk with serial %s\n", serial);
    die("disk");
    return NULL;
}

static const char *cfg_get(const char *key) {
    size_t kl = strlen(key);
    for (int i = 0; entries[i]; i++)
        if (strncmp(entries[i], key, kl) == 0 && entries[i][kl] == '=')
            return entries[i] + kl + 1;
    return NULL;
}

static void read_config(void) {
    int fd = open(disk("config"), O_RDONLY);
    if (fd < 0)
        die("open config disk");
    ssize_t got = 0, n;
    while (got < CFG_MAX - 2 && (n = read(fd, cfg + got, CFG_MAX - 2 - got)) > 0)
        got += n;
    close(fd);
    if (got < 8 || memcmp(cfg, "DSECCFG", 8) != 0) {
        errno = EINVAL;
        die("config disk has no DSECCFG header");
    }
    int ne = 0, nv = 0;
    for (char *p = cfg + 8; p < cfg + got && *p && ne < MAX_ENV; p += strlen(p) + 1) {
        entries[ne++] = p;
        if (strncmp(p, "dsec.", 5) != 0)
            envp[nv++] = p;
    }
    entries[ne] = envp[nv] = NULL;
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, text, strlen(text)) < 0)
        dprintf(2, "vminit: cannot write %s: %s\n", path, strerror(errno));
    if (fd >= 0)
        close(fd);
}

/* /etc/<name> with ``text``, kept on a tmpfs (/.dsec/run/ident/<name>, bind-mounted over
 * it, as container engines do for /etc/hostname and /etc/hosts). A fork child rewrites
 * these right after its restore (vmport.c, apply_identity): on tmpfs that is a
 * page-cache copy, on the overlay's ext4 it was a truncate, journal updates and block
 * allocation, all kernel code a restored QEMU translates again (~3,700 TCG blocks, ~12%
 * of a child's work until its first exec). Where the bind fails, a plain file. */
static void ident_file(const char *name, const char *text) {
    char src[96], dst[96];
    struct stat st;
    snprintf(src, sizeof src, "/newroot/.dsec/run/ident/%s", name);
    snprintf(dst, sizeof dst, "/newroot/etc/%s", name);
    mkdir("/newroot/etc", 0755);
    mkdir("/newroot/.dsec/run/ident", 0755);
    if (lstat(dst, &st) == 0 && S_ISLNK(st.st_mode))
        unlink(dst); /* may be a dangling symlink in the image */
    write_file(src, text);
    int fd = open(dst, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    if (fd < 0 || mount(src, dst, NULL, MS_BIND, NULL) != 0)
        write_file(dst, text);
}

static int agent_socket(void) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, "/.dsec/run/aether.sock");
    unlink(a.sun_path);
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 128) != 0)
        die("agent socket");
    chmod(a.sun_path, 0600);
    return s;
}

int vmport_main(void); /* vmport.c */

/* Run the channel multiplexer forever (linked in: no file to exec inside the new root;
 * it exits only on failure: start it again). */
static void start_mux(void) {
    if (fork() != 0)
        return;
    setsid();
    close(3);
    for (;;) {
        pid_t pid = fork();
        if (pid == 0)
            _exit(vmport_main());
        int st;
        if (pid > 0)
            waitpid(pid, &st, 0);
        usleep(200 * 1000);
    }
}

int main(void) {
    mkdir("/dev", 0755);
    mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    int con = open("/dev/console", O_RDWR);
    if (con >= 0) {
        dup2(con, 0), dup2(con, 1), dup2(con, 2);
        if (con > 2)
            close(con);
    }
    must_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    find_disks();
    read_config();

    mkdir("/mnt", 0755);
    must_mount(disk("bundle"), "/mnt/bundle", "erofs", MS_RDONLY, NULL);
    const char *nl = cfg_get("dsec.layers");
    int layers = nl ? atoi(nl) : 0;
    static char lower[8192];
    lower[0] = 0;
    for (int i = layers - 1; i >= 0; i--) {
        char serial[16], dir[32];
        snprintf(serial, sizeof serial, "l%d", i);
        snprintf(dir, sizeof dir, "/mnt/l%d", i);
        must_mount(disk(serial), dir, "erofs", MS_RDONLY, NULL);
        strcat(lower, lower[0] ? ":" : "");
        strcat(lower, dir);
    }
    /* noinit_itable: the scratch base is a sparse file (its inode tables read as zeros),
     * so the kernel's background zeroing of them is only guest CPU and disk writes, in
     * every VM and again in every fork child. */
    must_mount(disk("scratch"), "/mnt/scratch", "ext4", MS_NOATIME, "noinit_itable");
    mkdir("/mnt/scratch/upper", 0755);
    mkdir("/mnt/scratch/work", 0755);
    static char opts[9000];
    snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=/mnt/scratch/upper,workdir=/mnt/scratch/work",
             layers ? lower : "/mnt/bundle");
    must_mount("overlay", "/newroot", "overlay", 0, opts);

    const unsigned long nse = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    must_mount("proc", "/newroot/proc", "proc", nse, NULL);
    must_mount("devtmpfs", "/newroot/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    must_mount("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
               "newinstance,ptmxmode=0666,mode=0620,gid=5");
    unlink("/newroot/dev/ptmx");
    symlink("pts/ptmx", "/newroot/dev/ptmx");
    must_mount("shm", "/newroot/dev/shm", "tmpfs", nse, "mode=1777");
    must_mount("mqueue", "/newroot/dev/mqueue", "mqueue", nse, NULL);
    must_mount("sysfs", "/newroot/sys", "sysfs", nse, NULL);
    must_mount("cgroup2", "/newroot/sys/fs/cgroup", "cgroup2", nse, NULL);
    must_mount("/mnt/bundle", "/newroot/.dsec", NULL, MS_BIND, NULL);
    must_mount("tmpfs", "/newroot/.dsec/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "mode=700,size=16m");

    const char *host = cfg_get("DSEC_SANDBOX_ID");
    if (host) {
        static char hosts[512], line[128];
        sethostname(host, strlen(host));
        snprintf(line, sizeof line, "%s\n", host);
        ident_file("hostname", line);
        snprintf(hosts, sizeof hosts,
                 "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                 "127.0.1.1\t%s\n",
                 host);
        ident_file("hosts", hosts);
    }
    /* With sandbox networking the kernel configured eth0 from ip=; the edge's resolver */
    const char *resolv = cfg_get("dsec.resolv_conf");
    if (resolv) {
        mkdir("/newroot/etc", 0755);
        unlink("/newroot/etc/resolv.conf"); /* may be a dangling symlink in the image */
        write_file("/newroot/etc/resolv.conf", resolv);
    }
    const char *mid = cfg_get("dsec.machine_id");
    if (mid) {
        static char line[64];
        snprintf(line, sizeof line, "%s\n", mid);
        ident_file("machine-id", line);
    }
    const char *seed = cfg_get("dsec.seed");
    if (seed)
        write_file("/dev/urandom", seed);

    if (chdir("/newroot") != 0 || mount(".", "/", NULL, MS_MOVE, NULL) != 0 || chroot(".") != 0)
        die("switch root");
    chdir("/");
    /* The bundle is the same for every sandbox: keep it read-only inside. */
    mount(NULL, "/.dsec", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);

    int s = agent_socket();
    if (s != 3) {
        dup2(s, 3);
        close(s);
    }
    environ = envp;
    start_mux();
    char *argv[] = {"/.dsec/init", NULL};
    execve(argv[0], argv, envp);
    die("exec /.dsec/init");
    return 1;
}
