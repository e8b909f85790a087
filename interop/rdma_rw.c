/*
 * rdma_rw — RDMA WRITE / READ / FETCH_ADD exercise between two RC QPs, for interop runs
 * of metaroce's RoCEv2 mode against Linux rdma_rxe (see docs/INTEROP.md).
 *
 * Out-of-band exchange on TCP (default 18516): each side sends one 87-byte record
 *   "%04x:%06x:%06x:%32s:%08x:%016llx:%08x\0" = LID:QPN:PSN:GID:RKEY:VADDR:SIZE
 * (client first), connects its QP (RTR/RTS), then each writes 'R' and reads the peer's 'R'.
 * Phase 0: the client is active, phase 1: the server. The active side does ITERS times:
 * RDMA WRITE SIZE bytes of pattern(i) into the peer's target area, RDMA READ them back
 * and compare, FETCH_ADD 1 on the peer's 8-byte counter (expects i back). Then it writes
 * 'D'; the passive side checks its target area holds pattern(ITERS-1) and its counter is
 * ITERS and answers "OK" or "NO".
 *
 * Memory layout of the registered buffer (SIZE a multiple of 8):
 *   [0,S) target | [S,2S) write source | [2S,3S) read destination | [3S,3S+8) counter |
 *   [3S+8,3S+16) atomic result
 *
 * usage: rdma_rw [-d dev] [-g gid_idx] [-p port] [-s size] [-n iters] [-m mtu] [server]
 * Build: gcc -O2 -o rdma_rw rdma_rw.c -libverbs
 */
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define REC_LEN 87

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_qp *qp;
static struct ibv_mr *mr;
static uint8_t *buf;
static size_t S;

static int die(const char *m) { fprintf(stderr, "rdma_rw: %s\n", m); exit(1); }

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static uint8_t pat(uint32_t i, size_t j, uint8_t seed)
{
	return (uint8_t)(i * 7) + (uint8_t)(j * 13) + seed;
}

static int full_read(int fd, void *p, size_t n)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = read(fd, (char *)p + got, n - got);
		if (r <= 0)
			return -1;
		got += r;
	}
	return 0;
}

static int tcp_open(const char *server, int port)
{
	char ps[16];
	struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
	snprintf(ps, sizeof ps, "%d", port);
	if (server) {
		if (getaddrinfo(server, ps, &hints, &res))
			die("getaddrinfo");
		for (int tries = 0; tries < 600; tries++) {
			int fd = socket(AF_INET, SOCK_STREAM, 0);
			if (connect(fd, res->ai_addr, res->ai_addrlen) == 0)
				return fd;
			close(fd);
			usleep(100000);
		}
		die("connect");
	}
	hints.ai_flags = AI_PASSIVE;
	if (getaddrinfo(NULL, ps, &hints, &res))
		die("getaddrinfo");
	int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(ls, res->ai_addr, res->ai_addrlen) || listen(ls, 1))
		die("bind/listen");
	int fd = accept(ls, NULL, NULL);
	close(ls);
	if (fd < 0)
		die("accept");
	return fd;
}

/* Post one WR and wait for its completion. */
static int run_wr(struct ibv_send_wr *wr, const char *what)
{
	struct ibv_send_wr *bad;
	struct ibv_wc wc;
	if (ibv_post_send(qp, wr, &bad)) {
		fprintf(stderr, "rdma_rw: post %s failed\n", what);
		return -1;
	}
	double t0 = now_s();
	for (;;) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			return -1;
		if (n == 1)
			break;
		if (now_s() - t0 > 20) {
			fprintf(stderr, "rdma_rw: %s: no completion in 20 s\n", what);
			return -1;
		}
	}
	if (wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "rdma_rw: %s failed: %s (%d)\n", what, ibv_wc_status_str(wc.status), wc.status);
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	const char *dev = NULL, *server = NULL;
	int gidx = 1, port = 18516, mtu = 1024, op;
	uint32_t iters = 100;
	S = 4096;
	while ((op = getopt(argc, argv, "d:g:p:s:n:m:")) != -1) {
		switch (op) {
		case 'd': dev = optarg; break;
		case 'g': gidx = atoi(optarg); break;
		case 'p': port = atoi(optarg); break;
		case 's': S = strtoul(optarg, NULL, 0); break;
		case 'n': iters = strtoul(optarg, NULL, 0); break;
		case 'm': mtu = atoi(optarg); break;
		default: die("usage: rdma_rw [-d dev] [-g gid] [-p port] [-s size] [-n iters] [-m mtu] [server]");
		}
	}
	if (optind < argc)
		server = argv[optind];
	if (S == 0 || S % 8)
		die("size must be a non-zero multiple of 8");
	enum ibv_mtu m = mtu == 256 ? IBV_MTU_256 : mtu == 512 ? IBV_MTU_512 : mtu == 2048 ? IBV_MTU_2048
		: mtu == 4096 ? IBV_MTU_4096 : IBV_MTU_1024;

	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		die("no RDMA device");
	struct ibv_device *d = list[0];
	for (int i = 0; dev && list[i]; i++)
		if (!strcmp(ibv_get_device_name(list[i]), dev))
			d = list[i];
	if (!(ctx = ibv_open_device(d)) || !(pd = ibv_alloc_pd(ctx)) || !(cq = ibv_create_cq(ctx, 16, NULL, NULL, 0)))
		die("device/pd/cq");
	if (posix_memalign((void **)&buf, 4096, 3 * S + 16))
		die("memalign");
	memset(buf, 0, 3 * S + 16);
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	if (!(mr = ibv_reg_mr(pd, buf, 3 * S + 16, acc)))
		die("reg_mr");
	struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1}};
	if (!(qp = ibv_create_qp(pd, &ia)))
		die("create_qp");
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1, .qp_access_flags = acc};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("INIT");
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, gidx, &gid))
		die("query_gid");
	srand48(getpid() * time(NULL));
	uint32_t psn = lrand48() & 0xffffff;

	char mine[REC_LEN] = {0}, theirs[REC_LEN] = {0}, g[33];
	for (int i = 0; i < 16; i++)
		sprintf(g + 2 * i, "%02x", gid.raw[i]);
	snprintf(mine, sizeof mine, "%04x:%06x:%06x:%s:%08x:%016llx:%08x", 0, qp->qp_num, psn, g,
		 mr->rkey, (unsigned long long)(uintptr_t)buf, (unsigned)S);
	int fd = tcp_open(server, port);
	if (server) {
		if (write(fd, mine, REC_LEN) != REC_LEN || full_read(fd, theirs, REC_LEN))
			die("exchange");
	} else {
		if (full_read(fd, theirs, REC_LEN) || write(fd, mine, REC_LEN) != REC_LEN)
			die("exchange");
	}
	unsigned lid, rqpn, rpsn, rkey, rsize;
	unsigned long long raddr;
	char rg[33];
	if (sscanf(theirs, "%x:%x:%x:%32[0-9a-f]:%x:%llx:%x", &lid, &rqpn, &rpsn, rg, &rkey, &raddr, &rsize) != 7)
		die("bad peer record");
	if (rsize != S)
		die("peer size differs");
	union ibv_gid rgid;
	for (int i = 0; i < 16; i++) {
		unsigned v;
		sscanf(rg + 2 * i, "%2x", &v);
		rgid.raw[i] = v;
	}
	printf("  local  QPN 0x%06x PSN 0x%06x GID %s rkey 0x%08x va 0x%llx\n", qp->qp_num, psn, g, mr->rkey,
	       (unsigned long long)(uintptr_t)buf);
	printf("  remote QPN 0x%06x PSN 0x%06x GID %s rkey 0x%08x va 0x%llx\n", rqpn, rpsn, rg, rkey, raddr);

	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = m;
	a.dest_qp_num = rqpn;
	a.rq_psn = rpsn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = rgid;
	a.ah_attr.grh.sgid_index = gidx;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = psn;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
			  IBV_QP_MAX_QP_RD_ATOMIC))
		die("RTS");
	char c;
	if (write(fd, "R", 1) != 1 || full_read(fd, &c, 1))
		die("sync");

	int failed = 0;
	for (int phase = 0; phase < 2; phase++) {
		int active = (phase == 0) == (server != NULL);
		uint8_t seed = phase == 0 ? 0x11 : 0x55;
		double t0 = now_s();
		if (active) {
			for (uint32_t i = 0; i < iters; i++) {
				for (size_t j = 0; j < S; j++)
					buf[S + j] = pat(i, j, seed);
				struct ibv_sge sge = {.addr = (uintptr_t)(buf + S), .length = S, .lkey = mr->lkey};
				struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1,
					.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
				wr.wr.rdma.remote_addr = raddr;
				wr.wr.rdma.rkey = rkey;
				if (run_wr(&wr, "RDMA WRITE"))
					return 1;
				sge.addr = (uintptr_t)(buf + 2 * S);
				wr.opcode = IBV_WR_RDMA_READ;
				if (run_wr(&wr, "RDMA READ"))
					return 1;
				if (memcmp(buf + S, buf + 2 * S, S)) {
					fprintf(stderr, "rdma_rw: phase %d iter %u: READ returned other bytes\n", phase, i);
					return 1;
				}
				struct ibv_sge asge = {.addr = (uintptr_t)(buf + 3 * S + 8), .length = 8, .lkey = mr->lkey};
				struct ibv_send_wr aw = {.wr_id = 2, .sg_list = &asge, .num_sge = 1,
					.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED};
				aw.wr.atomic.remote_addr = raddr + 3 * S;
				aw.wr.atomic.rkey = rkey;
				aw.wr.atomic.compare_add = 1;
				if (run_wr(&aw, "FETCH_ADD"))
					return 1;
				uint64_t old;
				memcpy(&old, buf + 3 * S + 8, 8);
				if (old != i) {
					fprintf(stderr, "rdma_rw: phase %d iter %u: FETCH_ADD returned %llu\n", phase, i,
						(unsigned long long)old);
					return 1;
				}
			}
			char r[2];
			if (write(fd, "D", 1) != 1 || full_read(fd, r, 2))
				die("report");
			int ok = !memcmp(r, "OK", 2);
			failed |= !ok;
			double dt = now_s() - t0;
			printf("rdma_rw phase %d active: %u x (WRITE %zu B + READ %zu B + FETCH_ADD) in %.2f s = %.0f us/iter; "
			       "peer memory check: %s\n", phase, iters, S, S, dt, dt * 1e6 / (iters ? iters : 1), ok ? "OK" : "BAD");
		} else {
			if (full_read(fd, &c, 1))
				die("wait");
			int ok = 1;
			uint32_t last = iters ? iters - 1 : 0;
			for (size_t j = 0; iters && j < S; j++)
				ok &= buf[j] == pat(last, j, seed);
			uint64_t ctr;
			memcpy(&ctr, buf + 3 * S, 8);
			ok &= ctr == iters;
			if (write(fd, ok ? "OK" : "NO", 2) != 2)
				die("report");
			failed |= !ok;
			printf("rdma_rw phase %d passive: memory after peer's %u WRITEs and FETCH_ADDs: %s\n", phase, iters,
			       ok ? "OK" : "BAD");
			/* reset the counter so the next phase starts from 0 */
			memset(buf + 3 * S, 0, 8);
		}
	}
	close(fd);
	ibv_destroy_qp(qp);
	ibv_dereg_mr(mr);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	return failed;
}
