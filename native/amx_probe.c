// Whether this CPU, kernel and VM run AMX tiles: exit 0 when they do, else print why and exit 1.
// `make install-llamacpp LLAMA_AMX=1` builds llama.cpp's AMX kernels only where this passes; a tile instruction
// the kernel or VM does not enable dies with SIGILL, so the tiles run in a child process.
// Build: cc -O1 -mamx-tile -mamx-int8 native/amx_probe.c -o amx_probe

#include <immintrin.h>
#include <stdio.h>
#include <errno.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_SUPP 0x1021
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int run_tiles(void) {
    unsigned char config[64] = {0};
    config[0] = 1;  // palette 1
    config[16] = 64;  // tile 0: 64 bytes per row
    config[48] = 16;  // 16 rows
    _tile_loadconfig(config);
    _tile_zero(0);
    unsigned char out[16 * 64];
    _tile_stored(0, out, 64);
    _tile_release();
    for (size_t i = 0; i < sizeof out; i++) {
        if (out[i] != 0) {
            return 1;
        }
    }
    return 0;
}

int main(void) {
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_SUPP, &features) != 0) {
        puts("the kernel does not report extended CPU state (arch_prctl ARCH_GET_XCOMP_SUPP failed)");
        return 1;
    }
    if (!(features & (1UL << XFEATURE_XTILEDATA))) {
        puts("the CPU or VM does not enable AMX tile data (XTILEDATA not in ARCH_GET_XCOMP_SUPP)");
        return 1;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        printf("the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)\n", strerror(errno));
        return 1;
    }
    pid_t child = fork();
    if (child == 0) {
        _exit(run_tiles());
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child) {
        puts("could not run the tile test in a child process");
        return 1;
    }
    if (WIFSIGNALED(status)) {
        printf("a tile instruction died with signal %d (%s)\n", WTERMSIG(status), strsignal(WTERMSIG(status)));
        return 1;
    }
    if (WEXITSTATUS(status) != 0) {
        puts("tile instructions ran but returned wrong data");
        return 1;
    }
    return 0;
}
