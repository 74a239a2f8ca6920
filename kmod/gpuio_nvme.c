// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuio_nvme: hands an NVMe controller to a user-space driver where VFIO is not wanted or the
 * machine has no IOMMU. Bound explicitly (driver_override), it makes one character device per
 * controller, /dev/gpuio-nvmeN, whose single opener can
 *   - mmap offset 0: the controller's BAR0 (registers and doorbells), uncached;
 *   - ioctl GPUIO_NVME_IOC_ALLOC: a DMA-coherent buffer, returning its bus address (what the
 *     controller is given in PRPs and queue base registers) and the mmap offset to map it at;
 *   - ioctl GPUIO_NVME_IOC_FREE: free one again;
 *   - ioctl GPUIO_NVME_IOC_INFO: BAR0's size;
 *   - ioctl GPUIO_NVME_IOC_IMPORT: attach a dma-buf (another device's memory: a GPU's, exported
 *     by its driver) to the controller, peer-to-peer allowed, pin and map it, and return the
 *     bus address segments the controller reaches it at (Tier 2: data in GPU memory);
 *   - ioctl GPUIO_NVME_IOC_RELEASE: unmap and detach one again.
 * Bus mastering is on only while the device is open. Before buffers are freed or imports
 * released on close or the controller's removal, the controller is reset and bus mastering turned off,
 * and user mappings of what is freed are zapped, so neither a controller left running by a
 * dead process nor a stale mapping reaches freed memory. An open file may outlive the
 * controller's binding: the device structure is reference-counted, and its calls then fail.
 * The interface is mirrored in crates/gpuio-hal/src/nvme/kmod.rs.
 */
#include <linux/dma-mapping.h>
#include <linux/fs.h>
#include <linux/delay.h>
#include <linux/dma-buf.h>
#include <linux/dma-resv.h>
#include <linux/idr.h>
#include <linux/io-64-nonatomic-lo-hi.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

struct gpuio_nvme_alloc {
	__u64 size;     /* in: bytes (rounded up to pages) */
	__u64 bus_addr; /* out: the controller's address of byte 0 */
	__u64 offset;   /* out: the mmap offset that maps it */
};

struct gpuio_nvme_info {
	__u64 bar_size;
};

#define GPUIO_NVME_IOC_ALLOC _IOWR('g', 1, struct gpuio_nvme_alloc)
#define GPUIO_NVME_IOC_FREE _IOW('g', 2, __u64)
#define GPUIO_NVME_IOC_INFO _IOR('g', 3, struct gpuio_nvme_info)

struct gpuio_nvme_segment {
	__u64 bus_addr;
	__u64 len;
};

struct gpuio_nvme_import {
	__s32 fd;           /* in: a dma-buf */
	__u32 max_segments; /* in: room at segments */
	__u64 segments;     /* in: user address of struct gpuio_nvme_segment[max_segments] */
	__u64 size;         /* out: the dma-buf's size */
	__u32 count;        /* out: segments written (contiguous runs merged) */
	__u32 id;           /* out: what RELEASE takes */
};

#define GPUIO_NVME_IOC_IMPORT _IOWR('g', 4, struct gpuio_nvme_import)
#define GPUIO_NVME_IOC_RELEASE _IOW('g', 5, __u32)

/* Buffers are mapped at offsets from here up; offset 0 is BAR0. */
#define GPUIO_NVME_BUF_BASE (1ULL << 40)
/* The most one opener may hold, in bytes, and the largest single buffer (the page
 * allocator's largest block without CMA: larger requests fail instead of warning). */
#define GPUIO_NVME_MAX_BYTES (1ULL << 32)
#define GPUIO_NVME_MAX_BUFFER (4ULL << 20)
/* Imports one opener may hold, and segments one import may return (16 bytes each). */
#define GPUIO_NVME_MAX_IMPORTS 256
#define GPUIO_NVME_MAX_SEGMENTS (1U << 18)
/* NVMe controller registers the module touches itself. */
#define NVME_REG_CAP 0x00
#define NVME_REG_CC 0x14
#define NVME_REG_CSTS 0x1c

struct gpuio_nvme_buf {
	struct list_head node;
	void *cpu;
	dma_addr_t bus;
	size_t size;
	u64 offset;
};

/* An imported dma-buf: attached to the controller, pinned, mapped. */
struct gpuio_nvme_peer {
	struct list_head node;
	struct dma_buf *buf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	u32 id;
};

struct gpuio_nvme_dev {
	struct kref ref; /* probe's, and the open file's */
	struct pci_dev *pdev;
	void __iomem *bar;
	struct miscdevice misc;
	char name[32];
	int index;
	struct mutex lock;
	bool open;
	bool removed;
	/* The open file's mappings: zapped before memory they reach is freed. */
	struct address_space *mapping;
	struct list_head bufs;
	u64 next_offset;
	u64 held;
	struct list_head peers;
	u32 next_peer;
	u32 peers_held;
};

static DEFINE_IDA(gpuio_nvme_ida);

static struct gpuio_nvme_dev *to_dev(struct file *f)
{
	return container_of(f->private_data, struct gpuio_nvme_dev, misc);
}

static void gpuio_nvme_free_dev(struct kref *ref)
{
	kfree(container_of(ref, struct gpuio_nvme_dev, ref));
}

/* Zaps user mappings of [offset, offset + len) (len 0: all) so nothing reaches memory
 * about to be freed: a later access faults instead. Called with d->lock held. */
static void zap(struct gpuio_nvme_dev *d, u64 offset, u64 len)
{
	if (d->open && d->mapping)
		unmap_mapping_range(d->mapping, offset, len, 1);
}

static void free_buf(struct gpuio_nvme_dev *d, struct gpuio_nvme_buf *b)
{
	zap(d, b->offset, b->size);
	dma_free_coherent(&d->pdev->dev, b->size, b->cpu, b->bus);
	d->held -= b->size;
	list_del(&b->node);
	kfree(b);
}

/* Unmaps, unpins and detaches an import. Called with d->lock held, once nothing the
 * controller runs targets it. */
static void release_peer(struct gpuio_nvme_dev *d, struct gpuio_nvme_peer *p)
{
	dma_resv_lock(p->buf->resv, NULL);
	dma_buf_unmap_attachment(p->attach, p->sgt, DMA_BIDIRECTIONAL);
	dma_buf_unpin(p->attach);
	dma_resv_unlock(p->buf->resv);
	dma_buf_detach(p->buf, p->attach);
	dma_buf_put(p->buf);
	list_del(&p->node);
	d->peers_held--;
	kfree(p);
}

static void free_all(struct gpuio_nvme_dev *d)
{
	struct gpuio_nvme_buf *b, *n;
	struct gpuio_nvme_peer *p, *q;

	list_for_each_entry_safe(b, n, &d->bufs, node)
		free_buf(d, b);
	list_for_each_entry_safe(p, q, &d->peers, node)
		release_peer(d, p);
}

/* The exporter is about to move memory the controller may reach. Imports are pinned, so an
 * exporter that honours pins never calls this; one that does gets a controller told to stop
 * (CC.EN = 0, without waiting: this runs under the exporter's reservation lock). */
static void gpuio_nvme_move_notify(struct dma_buf_attachment *attach)
{
	struct gpuio_nvme_dev *d = attach->importer_priv;

	writel(0, d->bar + NVME_REG_CC);
}

static const struct dma_buf_attach_ops gpuio_nvme_importer = {
	.allow_peer2peer = true,
	.move_notify = gpuio_nvme_move_notify,
};

/* Attaches, pins and maps the dma-buf im->fd, and writes its bus address runs to segs.
 * Called with d->lock held. */
static long import_peer(struct gpuio_nvme_dev *d, struct gpuio_nvme_import *im,
			struct gpuio_nvme_segment *segs)
{
	struct gpuio_nvme_peer *p;
	struct scatterlist *sg;
	unsigned int i;
	long ret = 0;

	if (d->peers_held >= GPUIO_NVME_MAX_IMPORTS)
		return -EMFILE;
	p = kzalloc(sizeof(*p), GFP_KERNEL);
	if (!p)
		return -ENOMEM;
	p->buf = dma_buf_get(im->fd);
	if (IS_ERR(p->buf)) {
		ret = PTR_ERR(p->buf);
		kfree(p);
		return ret;
	}
	p->attach = dma_buf_dynamic_attach(p->buf, &d->pdev->dev, &gpuio_nvme_importer, d);
	if (IS_ERR(p->attach)) {
		ret = PTR_ERR(p->attach);
		goto put;
	}
	dma_resv_lock(p->buf->resv, NULL);
	ret = dma_buf_pin(p->attach);
	if (!ret) {
		p->sgt = dma_buf_map_attachment(p->attach, DMA_BIDIRECTIONAL);
		if (IS_ERR(p->sgt)) {
			ret = PTR_ERR(p->sgt);
			dma_buf_unpin(p->attach);
		}
	}
	dma_resv_unlock(p->buf->resv);
	if (ret)
		goto detach;
	im->count = 0;
	for_each_sgtable_dma_sg(p->sgt, sg, i) {
		dma_addr_t addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg);
		struct gpuio_nvme_segment *last = im->count ? &segs[im->count - 1] : NULL;

		if (last && last->bus_addr + last->len == addr) {
			last->len += len;
			continue;
		}
		if (im->count == im->max_segments) {
			ret = -E2BIG;
			goto unmap;
		}
		segs[im->count].bus_addr = addr;
		segs[im->count].len = len;
		im->count++;
	}
	im->size = p->buf->size;
	if (++d->next_peer == 0)
		d->next_peer = 1;
	p->id = d->next_peer;
	im->id = p->id;
	list_add(&p->node, &d->peers);
	d->peers_held++;
	return 0;
unmap:
	dma_resv_lock(p->buf->resv, NULL);
	dma_buf_unmap_attachment(p->attach, p->sgt, DMA_BIDIRECTIONAL);
	dma_buf_unpin(p->attach);
	dma_resv_unlock(p->buf->resv);
detach:
	dma_buf_detach(p->buf, p->attach);
put:
	dma_buf_put(p->buf);
	kfree(p);
	return ret;
}

/* Releases import `id`; -ENOENT if there is none. Called with d->lock held. */
static long release_peer_id(struct gpuio_nvme_dev *d, u32 id)
{
	struct gpuio_nvme_peer *p, *q;

	list_for_each_entry_safe(p, q, &d->peers, node) {
		if (p->id == id) {
			release_peer(d, p);
			return 0;
		}
	}
	return -ENOENT;
}

/* Resets the controller (CC.EN to 0) and waits, up to CAP.TO, for it to stop: a
 * controller left enabled by a process that died must not DMA into memory about to be
 * freed or handed to the next opener. Called with d->lock held. */
static void stop_controller(struct gpuio_nvme_dev *d)
{
	u64 cap = lo_hi_readq(d->bar + NVME_REG_CAP);
	unsigned long deadline = jiffies + msecs_to_jiffies(500 * max_t(u32, (cap >> 24) & 0xff, 1));

	if (readl(d->bar + NVME_REG_CSTS) == ~0u)
		return;
	writel(0, d->bar + NVME_REG_CC);
	while ((readl(d->bar + NVME_REG_CSTS) & 1) && time_before(jiffies, deadline))
		msleep(1);
}

static int gpuio_nvme_open(struct inode *inode, struct file *f)
{
	struct gpuio_nvme_dev *d = to_dev(f);
	int ret = 0;

	mutex_lock(&d->lock);
	if (d->removed) {
		ret = -ENODEV;
	} else if (d->open) {
		ret = -EBUSY;
	} else {
		d->open = true;
		d->mapping = f->f_mapping;
		d->next_offset = GPUIO_NVME_BUF_BASE;
		stop_controller(d);
		pci_set_master(d->pdev);
		kref_get(&d->ref);
	}
	mutex_unlock(&d->lock);
	return ret;
}

static int gpuio_nvme_release(struct inode *inode, struct file *f)
{
	struct gpuio_nvme_dev *d = to_dev(f);

	mutex_lock(&d->lock);
	if (!d->removed) {
		/* No DMA may reach the buffers once they are freed. */
		stop_controller(d);
		pci_clear_master(d->pdev);
		free_all(d);
	}
	d->open = false;
	d->mapping = NULL;
	mutex_unlock(&d->lock);
	kref_put(&d->ref, gpuio_nvme_free_dev);
	return 0;
}

static long gpuio_nvme_ioctl(struct file *f, unsigned int cmd, unsigned long arg)
{
	struct gpuio_nvme_dev *d = to_dev(f);
	void __user *uarg = (void __user *)arg;
	long ret = 0;

	/* Arguments are copied in and out without d->lock: a fault there takes mmap_lock,
	 * which mmap holds while it takes d->lock. */
	switch (cmd) {
	case GPUIO_NVME_IOC_ALLOC: {
		struct gpuio_nvme_alloc a;
		struct gpuio_nvme_buf *b;

		if (copy_from_user(&a, uarg, sizeof(a)))
			return -EFAULT;
		if (a.size == 0 || a.size > GPUIO_NVME_MAX_BUFFER)
			return a.size == 0 ? -EINVAL : -E2BIG;
		a.size = PAGE_ALIGN(a.size);
		b = kzalloc(sizeof(*b), GFP_KERNEL);
		if (!b)
			return -ENOMEM;
		mutex_lock(&d->lock);
		if (d->removed) {
			ret = -ENODEV;
		} else if (a.size > GPUIO_NVME_MAX_BYTES - d->held) {
			ret = -ENOMEM;
		} else {
			b->size = a.size;
			b->cpu = dma_alloc_coherent(&d->pdev->dev, b->size, &b->bus,
						    GFP_KERNEL | __GFP_NOWARN);
			if (!b->cpu) {
				ret = -ENOMEM;
			} else {
				b->offset = d->next_offset;
				d->next_offset += b->size;
				d->held += b->size;
				list_add(&b->node, &d->bufs);
				a.bus_addr = b->bus;
				a.offset = b->offset;
			}
		}
		mutex_unlock(&d->lock);
		if (ret) {
			kfree(b);
			return ret;
		}
		if (copy_to_user(uarg, &a, sizeof(a))) {
			mutex_lock(&d->lock);
			if (!d->removed)
				free_buf(d, b);
			mutex_unlock(&d->lock);
			return -EFAULT;
		}
		return 0;
	}
	case GPUIO_NVME_IOC_FREE: {
		struct gpuio_nvme_buf *b, *n;
		__u64 offset;

		if (copy_from_user(&offset, uarg, sizeof(offset)))
			return -EFAULT;
		ret = -ENOENT;
		mutex_lock(&d->lock);
		list_for_each_entry_safe(b, n, &d->bufs, node) {
			if (b->offset == offset) {
				free_buf(d, b);
				ret = 0;
				break;
			}
		}
		mutex_unlock(&d->lock);
		return ret;
	}
	case GPUIO_NVME_IOC_IMPORT: {
		struct gpuio_nvme_import im;
		struct gpuio_nvme_segment *segs;

		if (copy_from_user(&im, uarg, sizeof(im)))
			return -EFAULT;
		if (im.max_segments == 0 || im.max_segments > GPUIO_NVME_MAX_SEGMENTS)
			return -EINVAL;
		segs = kvcalloc(im.max_segments, sizeof(*segs), GFP_KERNEL);
		if (!segs)
			return -ENOMEM;
		mutex_lock(&d->lock);
		ret = d->removed ? -ENODEV : import_peer(d, &im, segs);
		mutex_unlock(&d->lock);
		if (!ret && (copy_to_user(u64_to_user_ptr(im.segments), segs,
					  (size_t)im.count * sizeof(*segs)) ||
			     copy_to_user(uarg, &im, sizeof(im)))) {
			mutex_lock(&d->lock);
			if (!d->removed)
				release_peer_id(d, im.id);
			mutex_unlock(&d->lock);
			ret = -EFAULT;
		}
		kvfree(segs);
		return ret;
	}
	case GPUIO_NVME_IOC_RELEASE: {
		__u32 id;

		if (copy_from_user(&id, uarg, sizeof(id)))
			return -EFAULT;
		mutex_lock(&d->lock);
		ret = d->removed ? -ENODEV : release_peer_id(d, id);
		mutex_unlock(&d->lock);
		return ret;
	}
	case GPUIO_NVME_IOC_INFO: {
		struct gpuio_nvme_info info;

		/* The PCI device is reached only while it is bound. */
		mutex_lock(&d->lock);
		ret = d->removed ? -ENODEV : 0;
		if (!ret)
			info.bar_size = pci_resource_len(d->pdev, 0);
		mutex_unlock(&d->lock);
		if (ret)
			return ret;
		if (copy_to_user(uarg, &info, sizeof(info)))
			return -EFAULT;
		return 0;
	}
	default:
		return -ENOTTY;
	}
}

static int gpuio_nvme_mmap(struct file *f, struct vm_area_struct *vma)
{
	struct gpuio_nvme_dev *d = to_dev(f);
	unsigned long len = vma->vm_end - vma->vm_start;
	u64 offset = (u64)vma->vm_pgoff << PAGE_SHIFT;
	struct gpuio_nvme_buf *b;
	int ret = -EINVAL;

	mutex_lock(&d->lock);
	if (d->removed) {
		ret = -ENODEV;
	} else if (offset == 0) {
		if (len <= pci_resource_len(d->pdev, 0)) {
			vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
			ret = io_remap_pfn_range(vma, vma->vm_start,
						 pci_resource_start(d->pdev, 0) >> PAGE_SHIFT,
						 len, vma->vm_page_prot);
		}
		mutex_unlock(&d->lock);
		return ret;
	}
	list_for_each_entry(b, &d->bufs, node) {
		if (b->offset == offset && len <= b->size) {
			/* dma_mmap_coherent reads vm_pgoff as an offset into the buffer; the file
			 * offset goes back after, so that zap() finds the mapping by its range. */
			vma->vm_pgoff = 0;
			ret = dma_mmap_coherent(&d->pdev->dev, vma, b->cpu, b->bus, len);
			vma->vm_pgoff = offset >> PAGE_SHIFT;
			break;
		}
	}
	mutex_unlock(&d->lock);
	return ret;
}

static const struct file_operations gpuio_nvme_fops = {
	.owner = THIS_MODULE,
	.open = gpuio_nvme_open,
	.release = gpuio_nvme_release,
	.unlocked_ioctl = gpuio_nvme_ioctl,
	.mmap = gpuio_nvme_mmap,
};

static int gpuio_nvme_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct gpuio_nvme_dev *d;
	int ret;

	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;
	ret = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (ret)
		return ret;
	ret = pcim_iomap_regions(pdev, BIT(0), "gpuio_nvme");
	if (ret)
		return ret;
	/* Not device-managed: an open file may outlive the device's binding. */
	d = kzalloc(sizeof(*d), GFP_KERNEL);
	if (!d)
		return -ENOMEM;
	kref_init(&d->ref);
	d->bar = pcim_iomap_table(pdev)[0];
	d->index = ida_alloc(&gpuio_nvme_ida, GFP_KERNEL);
	if (d->index < 0) {
		ret = d->index;
		kfree(d);
		return ret;
	}
	d->pdev = pdev;
	mutex_init(&d->lock);
	INIT_LIST_HEAD(&d->bufs);
	INIT_LIST_HEAD(&d->peers);
	snprintf(d->name, sizeof(d->name), "gpuio-nvme%d", d->index);
	d->misc.minor = MISC_DYNAMIC_MINOR;
	d->misc.name = d->name;
	d->misc.fops = &gpuio_nvme_fops;
	d->misc.parent = &pdev->dev;
	ret = misc_register(&d->misc);
	if (ret) {
		ida_free(&gpuio_nvme_ida, d->index);
		kfree(d);
		return ret;
	}
	pci_set_drvdata(pdev, d);
	dev_info(&pdev->dev, "gpuio_nvme: /dev/%s\n", d->name);
	return 0;
}

static void gpuio_nvme_remove(struct pci_dev *pdev)
{
	struct gpuio_nvme_dev *d = pci_get_drvdata(pdev);

	misc_deregister(&d->misc);
	mutex_lock(&d->lock);
	/* An open file stays, but reaches nothing: its mappings are zapped, its calls fail. */
	stop_controller(d);
	pci_clear_master(pdev);
	zap(d, 0, 0);
	free_all(d);
	d->removed = true;
	mutex_unlock(&d->lock);
	ida_free(&gpuio_nvme_ida, d->index);
	kref_put(&d->ref, gpuio_nvme_free_dev);
}

/* No IDs: the driver takes only controllers handed to it with driver_override. */
static const struct pci_device_id gpuio_nvme_ids[] = {
	{ 0 },
};
MODULE_DEVICE_TABLE(pci, gpuio_nvme_ids);

static struct pci_driver gpuio_nvme_driver = {
	.name = "gpuio_nvme",
	.id_table = gpuio_nvme_ids,
	.probe = gpuio_nvme_probe,
	.remove = gpuio_nvme_remove,
};
module_pci_driver(gpuio_nvme_driver);

MODULE_DESCRIPTION("gpuio: NVMe BAR0, DMA buffers and dma-buf imports for a user-space driver");
MODULE_IMPORT_NS(DMA_BUF);
MODULE_LICENSE("Dual MIT/GPL");
